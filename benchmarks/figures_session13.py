"""Tables of harvest run 31 (one H200, 2026-12-03, the thirteenth session): the rows, each over the best level of the
better of the capacity passes right before and after it; and vLLM's step beside the CPU's pace in every 512-token
phase, which shows the step changing by 1.8x where the pace probe moved a tenth.
Data: benchmarks/results/2026-12-03-h200-harvest-session13/."""

from __future__ import annotations

import json
from pathlib import Path

from figures_common import RESULTS, jsonl
from figures_harvest import _bracketed_rows, mix_phase
from figures_session11 import reading
from figures_session12 import _in_valleys

SESSION13 = RESULTS / "2026-12-03-h200-harvest-session13"
SESSION13_CODE = {"run31": "025aab6"}
PHASES_512 = ("capacity-128", "capacity-256", "capacity-512", "service-alone", "row fleet",
              "capacity-after-fleet-512", "row longtail", "capacity-after-longtail-512")
"""The 512-token mix's phases in the order they ran (a row: its valleys only)."""


def harvest_h200_session13() -> str:
    """Run 31: both mixes in one harvest.py, the engine core pinned, the service starting at 512 in flight; each row
    over the best level of the better of the passes right before and right after it (after a row, 512 in flight
    only). The run was stopped by its time limit in the last row (48-token ``longtail``): three rows."""
    return _bracketed_rows(SESSION13, SESSION13_CODE)


def harvest_h200_step_session13() -> str:
    """Every phase of the 512-token mix in run 31: vLLM's rate, its running count and step (over a pass's middle half,
    or over a row's valleys) and the pace probe's rate on the engine core's second CPU. At about 500 running the step
    was 10.3 ms in one row's valleys and 18.1 ms in the other's while the probe read 5.06 and 4.61: the engine core's
    speed moved by more than the probe says, so a row over a pass minutes apart reads what the host did between."""
    lines = ["| phase (in order) | tokens/s | running | step ms | CPU pace | tokens/s per unit of pace |",
             "|---|---|---|---|---|---|"]
    for phase, rate, running, step, pace in phase_readings(SESSION13, "run31", 512, PHASES_512):
        lines.append(f"| {phase} | {rate:.0f} | {running:.0f} | {step:.1f} | {pace:.2f} | {rate / pace:.0f} |")
    return "\n".join(lines)


def phase_readings(folder: Path, run: str, mix: int, phases: tuple[str, ...]) -> list[tuple[str, float, float, float, float]]:
    """(phase, tokens/s, running, step ms, CPU pace) for each of ``phases`` of one mix: a pass over its middle half,
    a row (``row PROFILE``) over its valleys only."""
    samples = jsonl(folder / run / "inflight.jsonl")
    out = []
    for phase in phases:
        if phase.startswith("row "):
            profile = phase.split()[1]
            row = json.loads((folder / run / f"row-{mix}-{profile}.json").read_text())
            inside = [s for s in samples if s["phase"] == f"timesliced-{mix}-{profile}"]
            pace, step, running = _in_valleys(inside, row["valleys"])
            rate = sum(v["tokens"] for v in row["valleys"]) / sum(v["seconds"] for v in row["valleys"])
            phase = f"{profile} row's valleys"
        else:
            rate, running, step, pace = reading(mix_phase(folder, run, mix, phase))
        out.append((phase, rate, running, step, pace))
    return out
