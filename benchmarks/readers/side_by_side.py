"""The side-by-side experiment's tables, for any of its runs: the test command beside a second copy of itself, each
on a fresh clone (``side-by-side.sh REPO WORK TAG``, kept in the raw data). Each ``TAG`` left three logs:
``TAG-ci-run.log`` (``.ci/run``: the README's test command, then the core-only step), ``TAG-beside.log`` (the README's
test command in the second clone) and ``TAG-status.log`` (each clone's ``git status`` after, the wall clock)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from readers.common import Run, pytest_failures, pytest_summaries, took


def _tags(run: Run) -> list[str]:
    """The tags, in the order they ran (their names sort so)."""
    return sorted(p.name.removesuffix("-status.log") for p in run.data.glob("*-status.log"))


def _suite(log: Path) -> tuple[str, str]:
    """(the README's test command, the core-only step) of a log: ``passed / failed / skipped in T``, ``–`` not run."""
    got = pytest_summaries(log.read_text())
    cells = [f"{s['passed']:.0f} / {s['failed']:.0f} / {s['skipped']:.0f} in {took(s['seconds'])}" for s in got]
    return (cells + ["–", "–"])[0], (cells + ["–", "–"])[1]


def runs(run: Run) -> str:
    """Each pair of suites started together: the commit both clones had, each suite's outcome (passed / failed /
    skipped), the wall clock of the pair, and whether both clones were left as cloned."""
    lines = ["| commit | `.ci/run`: README's command | `.ci/run`: core-only step | the copy beside it | wall | "
             "clones after |", "|---|---|---|---|---|---|"]
    for tag in _tags(run):
        ci, beside = run.data / f"{tag}-ci-run.log", run.data / f"{tag}-beside.log"
        status = (run.data / f"{tag}-status.log").read_text()
        commit = ci.read_text().split(maxsplit=1)[0]
        wall = re.search(r"^wall (\d+) s$", status, re.M)
        clean = all(line.endswith("[]") for line in status.splitlines() if line.startswith("clone "))
        command, core = _suite(ci)
        lines.append(f"| {commit} | {command} | {core} | {_suite(beside)[0]} | "
                     f"{took(int(wall.group(1))) if wall else '–'} | {'clean' if clean else 'CHANGED'} |")
    return "\n".join(lines)


def failed(run: Run) -> str:
    """Every test that failed, by commit and suite."""
    lines = ["| commit | suite | failed test |", "|---|---|---|"]
    for tag in _tags(run):
        ci = run.data / f"{tag}-ci-run.log"
        commit = ci.read_text().split(maxsplit=1)[0]
        for suite, log in (("`.ci/run`", ci), ("beside", run.data / f"{tag}-beside.log")):
            lines += [f"| {commit} | {suite} | `{test}` |" for test in pytest_failures(log.read_text())]
    return "\n".join(lines)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"runs": runs, "failed": failed}
