"""Tables of harvest runs 34–36 (one H200, 2026-12-03, the fifteenth session): the 7 B tenant of session 14 with the
warm-up's polite sleep bounded only from a trainer's ask (01ed72b). The rows as the issue scores them, each against the
bounds, also over the best pass of its whole run; each row's valleys lent and why not; every phase at 512 in flight.
Data: benchmarks/results/2026-12-03-h200-harvest-session15/."""

from __future__ import annotations

import json

from figures_common import RESULTS, _f
from figures_harvest import _bracketed_rows
from figures_session14 import lent_table, step_table

SESSION15 = RESULTS / "2026-12-03-h200-harvest-session15"
SESSION15_CODE = {"run34": "d6f08de", "run35": "d6f08de", "run36": "d6f08de"}
BOUNDS = {"serving_vs_capacity": (0.90, "≥"), "idle_vs_capacity": (0.85, "≥"), "step_ratio": (1.01, "≤"),
          "wait_s_median": (0.02, "≤"), "wait_s_max": (0.2, "≤")}
"""Issue 36's must-show 1: every time-sliced row of one run within these."""


def within(row: dict[str, float]) -> list[str]:
    """The keys of ``row`` outside issue 36's bounds (none: the row meets them all)."""
    return [k for k, (bound, sign) in BOUNDS.items() if (row[k] < bound if sign == "≥" else row[k] > bound)]


def harvest_h200_session15() -> str:
    """Runs 34–36: both mixes in one harvest.py each, the 7 B tenant, the engine core pinned, the service starting at
    512 in flight; each row over the best level of the better of the passes right before and right after it."""
    return _bracketed_rows(SESSION15, SESSION15_CODE)


def harvest_h200_bounds_session15() -> str:
    """Each row against issue 36's bounds: over its own reference (the better pass around it) and over the best pass
    of its whole run; the run meets must-show 1 when all four of its rows do."""
    lines = ["| run | mix | profile | serving / ref | idle / ref | over the run's best pass | step ratio | "
             "wait median / max s | outside the bounds |", "|---|---|---|---|---|---|---|---|---|"]
    for run in SESSION15_CODE:
        for mix in (512, 48):
            for profile in ("fleet", "longtail"):
                r = json.loads((SESSION15 / run / f"row-{mix}-{profile}.json").read_text())
                out = within(r)
                lines.append(f"| {run[3:]} | {mix} | {profile} | {_f(r['serving_vs_capacity'], 3)} | "
                             f"{_f(r['idle_vs_capacity'], 3)} | {_f(r['serving_vs_all_passes'], 3)} / "
                             f"{_f(r['idle_vs_all_passes'], 3)} | {_f(r['step_ratio'], 4)} | "
                             f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {', '.join(out) or 'none'} |")
    return "\n".join(lines)


def harvest_h200_lent_session15() -> str:
    """Each row's share of the trainer's idle time that went to vLLM, its valleys lent and skipped, the warm-up."""
    return lent_table(SESSION15, SESSION15_CODE)


def harvest_h200_step_session15() -> str:
    """Every phase at 512 in flight, both mixes, all three runs: vLLM's rate, running count, step, the CPU's pace."""
    return step_table(SESSION15, SESSION15_CODE)
