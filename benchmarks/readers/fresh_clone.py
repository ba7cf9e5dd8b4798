"""The fresh-clone experiment's tables, for any of its runs: the README's commands and ``.ci/run`` on fresh clones of
a loaded machine, each a log kept as it was written; the manifest's ``parts`` lists them in the order they ran, each
with what ran (the run's README.md says how)."""

from __future__ import annotations

import re
from typing import Callable

from readers.common import Run, pytest_failures, pytest_summaries, took

REAL = re.compile(r"^real\s+(\d+)m([\d.]+)s$", re.M)
"""``time``'s wall clock at a log's end: the install and every step."""
REPEAT = re.compile(r"^\w+ \d+: (.*)$", re.M)
"""A line of a repeated pytest command's log (``multinode-20.sh``): pytest's last line for that pass."""
PASSED = re.compile(r"^(\d+) passed in ([\d.]+)s$")
"""Such a line where every test passed: how many, and the seconds."""
STEPS = re.compile(r"^job \S+: (\d+) steps in ([\d.]+) s$", re.M)
BATCH = re.compile(r"(\d+) of (\d+) lines answered \(.*?(\d+) lost\)")
INTACT = re.compile(r"worker data intact: (\w+)")


def _table(run: Run, columns: list[str], cells: Callable[[str], list[list[str]]]) -> str:
    """A row for each of ``cells(log text)`` after the label of the log it came from, logs in the order they ran."""
    lines = ["| what ran | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, label in run.manifest["parts"]:
        lines += [f"| {label} | " + " | ".join(row) + " |" for row in cells((run.data / name).read_text())]
    return "\n".join(lines)


def _suites(text: str) -> list[list[str]]:
    got = pytest_summaries(text)
    if not got:
        return []
    first, real = got[0], REAL.search(text)
    core = f"{got[1]['passed']:.0f} / {got[1]['failed']:.0f} in {took(got[1]['seconds'])}" if len(got) > 1 else "–"
    return [[f"{first['passed']:.0f} / {first['failed']:.0f} / {first['skipped']:.0f}", took(first["seconds"]), core,
             took(int(real.group(1)) * 60 + float(real.group(2))) if real else "–"]]


def runs(run: Run) -> str:
    """Each test suite's outcome: the README's test command (or ``.ci/run``'s first step), ``.ci/run``'s core-only
    step where it ran, and the wall clock with the install where the log has it."""
    return _table(run, ["tests passed / failed / skipped", "in", "core-only step: passed / failed",
                        "wall, install included"], _suites)


def _repeats(text: str) -> list[list[str]]:
    found = REPEAT.findall(text)
    passed = [m.groups() for line in found if (m := PASSED.match(line))]
    seconds = [float(s) for _, s in passed] or [0.0]
    return [[f"{len(passed)} of {len(found)}", ", ".join(sorted({n for n, _ in passed})) or "–",
             f"{min(seconds):.1f}–{max(seconds):.1f}"]] if found else []


def repeated(run: Run) -> str:
    """A test file run again and again under load (``tests/test_multinode.py`` and its rank aborted at exit)."""
    return _table(run, ["runs passed", "tests a run", "seconds a run (fastest–slowest)"], _repeats)


def _demo(text: str) -> list[list[str]]:
    steps, batch, intact = STEPS.search(text), BATCH.search(text), INTACT.search(text)
    if not (steps and batch and intact):
        return []
    return [[f"{steps.group(1)} in {steps.group(2)} s", f"{batch.group(1)} of {batch.group(2)}", batch.group(3),
             "yes" if intact.group(1) == "True" else "NO"]]


def demo(run: Run) -> str:
    """The README's first command: the dry run's steps, the batch lines it answered and lost, the worker's data."""
    return _table(run, ["steps", "batch lines answered", "lost", "worker data intact"], _demo)


def failed(run: Run) -> str:
    """Every test that failed, in the suite that it failed in."""
    return _table(run, ["failed test"], lambda text: [[f"`{test}`"] for test in pytest_failures(text)])


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"runs": runs, "repeated": repeated, "demo": demo, "failed": failed}
