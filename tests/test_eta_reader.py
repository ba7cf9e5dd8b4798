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


GATE = [{"at": 0.0, "open": False}, {"at": 10.0, "open": True}, {"at": 20.0, "open": False}, {"at": 30.0, "open": True}]
"""Shut 10 s, open 10 s, shut 10 s, open from then on."""


def test_the_replay_reads_the_valley_share_and_the_valleys_still_to_come_off_the_gates_log():
    from eta_replay import open_share, wall_s

    assert open_share(GATE, 40.0, 40.0) == 0.5 and open_share(GATE, 40.0, 10.0) == 1.0
    assert open_share(GATE, 0.0, 60.0) is None
    assert wall_s(GATE, 5.0, 5.0) == 10.0  # shut until 10, then 5 s open
    assert wall_s(GATE, 12.0, 10.0) == 20.0  # 8 s open until 20, shut until 30, 2 s more


def test_the_replay_puts_a_runs_readings_through_the_estimate_with_or_without_what_lines_ask_for(tmp_path):
    """One batch of 100 lines asking 10 tokens, at 10 tokens per wall second: 100 s; without the prior the service's
    mean of 5 tokens a line stands in: 50 s."""
    from eta_replay import replay

    _write(tmp_path / "batches.jsonl", [{"id": "a", "status": "completed", "created_at": 1000, "ended_at": 1100,
                                         "expires_at": 99999, "lines": 100, "max_tokens": 10, "priority": 0,
                                         "owner": 0}])
    _write(tmp_path / "observations.jsonl", [{"id": "a", "at": 1000.0, "status": "in_progress", "completed": 0,
                                              "failed": 0, "total": 100, "eta_at": 5000}])
    _write(tmp_path / "speed.jsonl", [{"at": 1000.5, "speed": {"tokens_per_open_s": 20.0, "lines_per_open_s": 4.0,
                                                               "open_share": 0.5, "window_s": 300.0}}])
    _write(tmp_path / "gate.jsonl", GATE)
    for prior, eta_s in ((True, 100.0), (False, 50.0)):
        out = replay(tmp_path, tmp_path / f"out-{prior}", prior=prior)
        (got,) = [json.loads(line) for line in (out / "observations.jsonl").read_text().splitlines()]
        assert (got["eta_s"], got["eta_at"]) == (eta_s, 1000.0 + eta_s)
        assert summary_line(out).startswith(f"median |ETA error| {abs(eta_s - 100):.1f} % of the time left")
