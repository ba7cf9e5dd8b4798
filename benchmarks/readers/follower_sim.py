"""The follower-sim experiment's tables, for any of its runs: the feeder's in-flight limit against a modelled vLLM
(``benchmarks/follower_sim.py``, ``sim.json``): every row, and the means and worst row per valley length."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from readers.common import Run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rows(run: Run) -> list[dict]:
    return json.loads((run.data / "sim.json").read_text())["rows"]


def rows(run: Run) -> str:
    from follower_sim import row_table

    return row_table(_rows(run))


def summary(run: Run) -> str:
    from follower_sim import summary_table

    return summary_table(_rows(run))


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows, "summary": summary}
