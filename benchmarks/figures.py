"""Every measured table of the README, docs/ and the guides, printed from a committed run by its experiment's reader.

A run is a folder ``benchmarks/results/EXPERIMENT/DATE-MACHINE[-x]/`` (``manifest.json``, raw data in ``raw.tar.gz``);
``benchmarks/readers/EXPERIMENT.py`` reads any run of its experiment. A document carries a table between
``<!-- figures:EXPERIMENT/RUN:TABLE -->`` and ``<!-- /figures -->``, which names the run and the table it came from. ::

    python benchmarks/figures.py benchmarks/results/harvest/2026-12-03-h200   # a run's manifest and every table
    python benchmarks/figures.py harvest/2026-12-03-h200 bounds                # one of its tables
    python benchmarks/figures.py --list                                        # every run and its tables
    python benchmarks/figures.py --check      # exit 1 when a document's table differs from its run's data
    python benchmarks/figures.py --write      # rewrite the documents' tables from the data

``tests/test_figures.py`` runs the check.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "verl_run"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from readers.common import RESULTS, Run, open_run, runs  # noqa: E402

DOCS = ("README.md", "docs/measured.md", "docs/architecture.md", "guides/rl-batch-interleaving/README.md",
        "guides/multi-gpu-trainers.md", "guides/batch-cluster.md", "tests/reliability/README.md")
"""The documents that carry generated tables or cite runs."""
BLOCK = re.compile(r"(<!-- figures:([\w.-]+/[\w.-]+):([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)
CITE = re.compile(r"benchmarks/results/([a-z][\w-]*/20[0-9]{2}-[\w.-]+)")


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    """The tables the reader of ``run``'s experiment prints for it (none for an experiment that has only notes)."""
    module = run.manifest["experiment"].replace("-", "_")
    if not (ROOT / "benchmarks" / "readers" / f"{module}.py").exists():
        return {}
    return importlib.import_module(f"readers.{module}").tables(run)


def table(name: str, which: str) -> str:
    """Table ``which`` of the run ``name`` (``EXPERIMENT/RUN``)."""
    run = open_run(RESULTS / name)
    got = tables(run)
    if which not in got:
        raise KeyError(f"{name} has no table {which!r} (it has: {', '.join(got) or 'none'})")
    return got[which](run)


def documents(root: Path = ROOT) -> dict[str, str]:
    return {name: (root / name).read_text() for name in DOCS}


def stale(root: Path = ROOT) -> list[str]:
    """``doc: run:table`` for every generated block that differs from what its run's data gives or names no table."""
    out = []
    for doc, text in documents(root).items():
        for match in BLOCK.finditer(text):
            name, which = match.group(2), match.group(3)
            try:
                fresh = table(name, which)
            except (FileNotFoundError, KeyError) as e:
                out.append(f"{doc}: {e}")
                continue
            if match.group(4).strip() != fresh.strip():
                out.append(f"{doc}: {name}:{which}")
    return out


def cited(root: Path = ROOT) -> set[str]:
    """``EXPERIMENT/RUN`` of every run a document cites, by path or through a generated table."""
    found: set[str] = set()
    for text in documents(root).values():
        found |= {m.group(1).rstrip(".") for m in CITE.finditer(text)}
        found |= {m.group(2) for m in BLOCK.finditer(text)}
    return found


def write(root: Path = ROOT) -> None:
    for doc, text in documents(root).items():
        new = BLOCK.sub(lambda m: m.group(1) + table(m.group(2), m.group(3)) + "\n" + m.group(5), text)
        if new != text:
            (root / doc).write_text(new)


def show(folder: str, which: str | None) -> None:
    run = open_run(folder)
    if which is None:
        print(f"# {run.name}\n")
        for key, value in run.manifest.items():
            print(f"- {key}: {value}")
        print()
    for name, make in tables(run).items():
        if which in (None, name):
            print(f"## {name}\n{make(run)}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a run's folder, or EXPERIMENT/RUN under benchmarks/results")
    parser.add_argument("table", nargs="?", help="one of the run's tables (default: all)")
    parser.add_argument("--list", action="store_true", help="every committed run and its tables")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.check:
        bad = stale()
        for line in bad:
            print(f"differs from its data: {line}", file=sys.stderr)
        return 1 if bad else 0
    if args.write:
        write()
        return 0
    if args.list or not args.run:
        for folder in runs():
            run = open_run(folder)
            print(f"{run.name}: {', '.join(tables(run)) or '(notes only)'} — {run.manifest['summary']}")
        return 0
    show(args.run, args.table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
