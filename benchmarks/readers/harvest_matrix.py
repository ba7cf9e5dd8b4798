"""The harvest matrix's tables (``benchmarks/harvest_matrix.py``): every row of its covering design of valley shapes.

Read from the raw rows, not from the ``matrix.json`` a call left: the design (``design.json``) says which rows there are,
each ``row-<factors>.json`` what one gave, and each completion length's ``capacity-<length>-{before,after}.json`` the
reference its rows are read over (the best steady level of both passes). A matrix recorded from its ``--out`` folder
holds it one level down (under the folder's own name) or at the top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from harvest_design import rows_from, summary, summary_table
from readers.common import Run, _f


def folder(run: Run) -> Path:
    """The matrix's ``--out`` inside the run's raw data: where ``design.json`` lies."""
    found = [p.parent for p in (run.data / "design.json", *sorted(run.data.glob("*/design.json"))) if p.exists()]
    if len(found) != 1:
        raise FileNotFoundError(f"{run.name}: {len(found)} matrices (a design.json each) in its data; a run holds one")
    return found[0]


def _summary(run: Run) -> dict:
    out = folder(run)
    return summary(out, rows_from(json.loads((out / "design.json").read_text())))


def rows(run: Run) -> str:
    """Every row of the design: its factors, serving and idle over capacity, the trainer's cost, lines cut/resumed."""
    return summary_table(_summary(run))


def capacity(run: Run) -> str:
    """Each completion length's capacity, tokens/s: the best steady level before its rows and after them."""
    lines = ["| completion tokens | before the rows | after the rows | after / before |", "|---|---|---|---|"]
    for length, passes in _summary(run)["capacity"].items():
        before, after = passes["before"], passes["after"]
        lines.append(f"| {length} | {_f(before, 0)} | {_f(after, 0)} | "
                     f"{_f(after / before if before and after else None, 3)} |")
    return "\n".join(lines)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows, "capacity": capacity}
