"""The swap benchmark's report: byte figures per rank whatever the number of ranks one agent freezes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from swap_report import summarize  # noqa: E402

GB = 1e9


def _rank(mode: str, world: int, local_world: int | None, *, parked: float, node_bytes: float, node_left: float) -> dict:
    """One rank's record: two cycles; the agent's freeze covers every rank of the node at once."""
    cycles = []
    for i in range(2):
        t = 100.0 * i
        freeze = {"action": "freeze", "start": t + 0.1, "end": t + 0.6, "bytes": node_bytes, "left": node_left,
                  "phases": {"lock": 0.001, "checkpoint": 0.4}}
        thaw = {"action": "thaw", "start": t + 2.0, "end": t + 2.3, "bytes": node_bytes}
        cycles.append({"t_release": t, "t_released": t + 0.6, "t_acquire": t + 2.0, "t_acquired": t + 2.4,
                       "t_stepped": t + 2.5, "live": int(1.0 * GB), "parked": int(parked), "park_s": 0.1, "unpark_s": 0.1,
                       "acquire_s": 0.4, "step_s": 0.1, "transitions": [freeze, thaw], "identical": True})
    counts = {"completed": 0, "aborted": 0, "errors": 0}
    rank = {"world": world, "pinned_rate": 10 * GB, "solo": {"step_s": [0.1, 0.1], "losses": [1.0, 0.9]},
            "phases": [{"mode": mode, "prepare": False, "cycles": cycles, "losses": [1.0, 0.9],
                        "load_before": counts, "load_after": counts}]}
    if local_world is not None:
        rank["local_world"] = local_world
    return rank


@pytest.mark.parametrize(
    ("mode", "world", "local_world", "parked", "node_bytes", "node_left", "moved_gb", "left_gb"),
    [
        ("checkpoint", 1, None, 0, 4 * GB, 0, 4.0, 0.0),            # one GPU: the node is the rank
        ("checkpoint", 2, 2, 0, 4 * GB, 0, 2.0, 0.0),               # one agent froze both ranks: half each
        ("checkpoint", 2, None, 0, 4 * GB, 0, 2.0, 0.0),            # records from before local_world: world
        ("checkpoint", 4, 2, 0, 4 * GB, 0, 2.0, 0.0),               # two nodes of two: the node agent's two
        ("park", 2, 2, 1 * GB, 0, 2 * GB, 1.0, 1.0),                # park: the rank's own bytes; left per rank
        ("park+checkpoint", 2, 2, 1 * GB, 2 * GB, 0, 2.0, 0.0),     # parked + its share of the checkpoint
    ],
)
def test_byte_figures_are_per_rank(mode, world, local_world, parked, node_bytes, node_left, moved_gb, left_gb):
    rank = _rank(mode, world, local_world, parked=parked, node_bytes=node_bytes, node_left=node_left)
    (row,) = summarize(rank, [rank])
    assert row["moved_gb"] == pytest.approx(moved_gb)
    assert row["left_gb"] == pytest.approx(left_gb)
    assert row["pinned_s"] == pytest.approx(moved_gb * GB / rank["pinned_rate"])
