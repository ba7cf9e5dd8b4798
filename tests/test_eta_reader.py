"""The ETA experiment's reader: each completed batch's ETA read at points of its life, its error as a share of the
time the batch then still had to run; readings too near the end, of batches that did not complete, or without an
ETA (cold) left out of the figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks import their siblings

from readers.eta import summary_line  # noqa: E402


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_error_is_read_at_four_points_of_a_batchs_life_as_a_share_of_the_time_left(tmp_path):
    _write(tmp_path / "batches.jsonl", [
        {"id": "a", "status": "completed", "created_at": 1000, "ended_at": 1100},
        {"id": "b", "status": "expired", "created_at": 1000, "ended_at": 1300}])  # not completed: left out
    reading = lambda bid, at, eta_at: {"id": bid, "at": at, "status": "in_progress", "eta_at": eta_at}  # noqa: E731
    _write(tmp_path / "observations.jsonl", [
        reading("a", 1000, 1110),   # 100 s left, 10 s late: +10 %
        reading("a", 1025, 1100),   # exact
        reading("a", 1050, 1090),   # 50 s left, 10 s early: -20 %
        reading("a", 1075, 1105),   # 25 s left, 5 s late: +20 %
        reading("a", 1090, 2000),   # 10 s before the end: too near to weigh
        reading("b", 1000, 9999)])
    assert summary_line(tmp_path).startswith("median |ETA error| 15.0 % of the time left (4 readings at 0/25/50/75 % "
                                             "of 1 completed batches' lives")
