"""Tables of harvest run 30 (one H200, 2026-12-03, the twelfth session): the rows, each over the best level of the
better of the capacity passes right before and after it (``--bracket-rows``), the service starting at 512 in flight;
and the CPU's pace beside vLLM's rate in every pass and in the rows' valleys (``CPU_PROBE=15``: the pace probe on one
of the engine core's two CPUs, ``cpu_rate`` the probe's own rate, comparable across the run).
Data: benchmarks/results/2026-12-03-h200-harvest-session12/."""

from __future__ import annotations

import json
import statistics
from itertools import pairwise
from typing import Any

from figures_common import RESULTS
from figures_harvest import _bracketed_rows, mix_phase
from figures_limits import by_limit
from figures_session11 import reading

SESSION12 = RESULTS / "2026-12-03-h200-harvest-session12"
SESSION12_CODE = {"run30": "194d178"}
RUN = SESSION12 / "run30"
PASSES = (("before", ""), ("after fleet", "after-fleet-"), ("after longtail", "after-longtail-"))


def harvest_h200_session12() -> str:
    """Run 30: both mixes in one harvest.py, the engine core pinned, the service starting at 512 in flight; each row
    over the best level of the better of the passes right before and right after it."""
    return _bracketed_rows(SESSION12, SESSION12_CODE)


def harvest_h200_by_limit_session12() -> str:
    return by_limit([(SESSION12, run) for run in SESSION12_CODE])


def _mean(values: list[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else float("nan")


def _in_valleys(samples: list[dict[str, Any]], valleys: list[dict[str, Any]]) -> tuple[float, float, float]:
    """The CPU's mean pace, vLLM's step length in ms and its mean running count over the samples taken inside the
    row's valleys. The step is the median over 100 ms pairs of samples inside one: the first token of a request held
    over a pause counts the whole pause as one inter-token gap, and a sum over the valley would carry it."""
    spans = [(v["start"], v["start"] + v["seconds"]) for v in valleys]
    inside = [s for s in samples if any(t0 <= s["t"] <= t1 for t0, t1 in spans)]
    pairs = [(a, b) for a, b in pairwise(inside) if b["t"] - a["t"] < 0.2]
    steps = [(b["itl_sum"] - a["itl_sum"]) / (b["itl_count"] - a["itl_count"]) for a, b in pairs
             if b["itl_count"] > a["itl_count"]]
    return (_mean([s.get("cpu_rate") for s in inside]), 1000 * statistics.median(steps),
            _mean([s["running"] for s in inside]))


def harvest_h200_cpu_pace() -> str:
    """Every capacity pass of run 30 at each level by vLLM's counter over its middle half, with the pace of the engine
    core's CPU: with 512-token answers the rate followed the pace at every level (correlation over the three passes),
    its engine core's main thread at 0.95-0.97 of a core throughout."""
    lines = ["| mix | in flight | " + " | ".join(f"{name}: tokens/s, running, step ms, CPU pace" for name, _ in PASSES)
             + " | tokens/s per unit of pace, lowest to highest | rate vs pace, correlation |", "|---|---|---|---|---|---|---|"]
    for mix in (512, 48):
        for level in (128, 256, 512):
            readings = [reading(mix_phase(SESSION12, "run30", mix, f"capacity-{tag}{level}")) for _, tag in PASSES]
            cells = [f"{r:.0f}, {n:.0f}, {s:.2f}, {p:.2f}" for r, n, s, p in readings]
            per = "–".join(f"{r / p:.0f}" for r, _, _, p in sorted(readings, key=lambda x: x[0] / x[3]))
            corr = statistics.correlation([p for *_, p in readings], [r for r, *_ in readings])
            lines.append(f"| {mix} | {level} | " + " | ".join(cells) + f" | {per} | {corr:.2f} |")
    return "\n".join(lines)


def _reference_phase(got: dict[str, Any], mix: int, ref: float) -> str:
    """The sampler's phase of the capacity level that gave a row's reference (its client's steady rate)."""
    passes = [("", got["capacity"]), ("after-longtail-", got["capacity_after"]),
              *((f"after-{p}-", levels) for p, levels in got.get("capacity_between", {}).items())]
    for tag, levels in passes:
        for level in levels:
            if abs(level["steady_tokens_per_s"] - ref) < 0.05:
                return f"capacity-{tag}{level['inflight']}"
    raise ValueError(f"no capacity level of mix {mix} reads {ref}")


def harvest_h200_at_pace() -> str:
    """Each row of run 30 beside the CPU's pace in its valleys and in the capacity level that is its reference: the
    issue's figure (``serving_vs_capacity``), and that figure scaled by the two paces (the row as if its valleys had
    run at the reference's pace). The second is not the issue's figure: it says how much of the gap is the host's
    CPU. It holds for the 512-token mix, whose rate followed the pace; the 48-token mix's did not (table
    ``harvest-h200-cpu-pace``)."""
    lines = [("| mix, profile | serving / ref | idle / ref | reference level: CPU pace, step ms, running | the row's valleys: "
              "CPU pace, step ms, running | serving / idle scaled by the paces |"), "|---|---|---|---|---|---|"]
    samples = [json.loads(line) for line in (RUN / "inflight.jsonl").read_text().splitlines()]
    mixes = json.loads((RUN / "harvest.json").read_text())["mixes"]
    for mix in (512, 48):
        for profile in ("fleet", "longtail"):
            r = json.loads((RUN / f"row-{mix}-{profile}.json").read_text())
            phase = _reference_phase(mixes[str(mix)], mix, r["capacity_tokens_per_s"])
            _, ref_running, ref_step, ref_pace = reading(mix_phase(SESSION12, "run30", mix, phase))
            pace, step, running = _in_valleys(samples, r["valleys"])
            scale = ref_pace / pace
            lines.append(f"| {mix}, {profile} | {r['serving_vs_capacity']:.3f} | {r['idle_vs_capacity']:.3f} | "
                         f"{phase}: {ref_pace:.2f}, {ref_step:.1f}, {ref_running:.0f} | {pace:.2f}, {step:.1f}, {running:.0f} | "
                         f"{r['serving_vs_capacity'] * scale:.3f} / "
                         f"{r['idle_vs_capacity'] * scale:.3f} |")
    return "\n".join(lines)

