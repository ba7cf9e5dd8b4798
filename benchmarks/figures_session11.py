"""Tables of harvest run 29 and of the pace rounds after it (one H200, 2026-12-03, the eleventh session): the rows, each
bracketed by a capacity pass right before and right after it (``--bracket-rows``); the passes side by side with the
CPU pace read beside them; py-spy's stacks of the engine core in a slow pass and a fast one; five passes back to back
with nothing else running. Data: benchmarks/results/2026-12-03-h200-harvest-session11/."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from engine_profile import load, summary
from figures_common import RESULTS
from figures_harvest import _bracketed_rows, mix_phase
from figures_limits import _steady, by_limit

SESSION11 = RESULTS / "2026-12-03-h200-harvest-session11"
SESSION11_CODE = {"run29": "e8b727b"}
PASSES = (("before", ""), ("after fleet", "after-fleet-"), ("after longtail", "after-longtail-"))
"""The capacity passes of a mix in run 29, by when they ran: before the rows, after each."""


def harvest_h200_session11() -> str:
    """Run 29: both mixes in one harvest.py, the engine core pinned, each row over the best of the passes right before
    and right after it."""
    return _bracketed_rows(SESSION11, SESSION11_CODE)


def harvest_h200_by_limit_session11() -> str:
    return by_limit([(SESSION11, run) for run in SESSION11_CODE])


def _mid_mean(samples: list[dict[str, Any]], key: str) -> float | None:
    mid = [s.get(key) for s in samples[len(samples) // 4: 3 * len(samples) // 4]]
    values = [v for v in mid if v is not None]
    return sum(values) / len(values) if values else None


def reading(samples: list[dict[str, Any]]) -> tuple[float, float, float, float | None]:
    """Over a phase's middle half: vLLM's rate (its counter), its mean running count, its step's length in ms (its
    inter-token latency) and the CPU's pace (``cpu_rate``; None where no probe ran)."""
    mid = samples[len(samples) // 4: 3 * len(samples) // 4]
    a, b = mid[0], mid[-1]
    rate = (b["generated"] - a["generated"]) / (b["t"] - a["t"])
    step = 1000 * (b["itl_sum"] - a["itl_sum"]) / max(1.0, b["itl_count"] - a["itl_count"])
    return rate, _mid_mean(samples, "running") or 0.0, step, _mid_mean(samples, "cpu_rate")


def harvest_h200_passes_session11() -> str:
    """Every capacity pass of run 29 by vLLM's own counter over its middle half, the mean running count, and the pace
    of a CPU beside the engine core's (``cpu_speed``: fixed interpreter work per CPU-second on CPU 13, over its first
    reading of the run)."""
    lines = ["| mix | requests in flight | " + " | ".join(f"{name}: tokens/s, running, CPU pace" for name, _ in PASSES)
             + " | highest / lowest |", "|---|---|---|---|---|---|"]
    for mix in (512, 48):
        for level in (128, 256, 512):
            cells, rates = [], []
            for _, tag in PASSES:
                samples = mix_phase(SESSION11, "run29", mix, f"capacity-{tag}{level}")
                rates.append(_steady(samples))
                cells.append(f"{rates[-1]:.0f}, {_mid_mean(samples, 'running'):.0f}, "
                             f"{_mid_mean(samples, 'cpu_speed'):.2f}")
            lines.append(f"| {mix} | {level} | " + " | ".join(cells) + f" | {max(rates) / min(rates):.2f} |")
    return "\n".join(lines)


STACK_PARTS = ("GPUModelRunner.execute_model (gpu_model_runner.py)", "Scheduler.schedule (scheduler.py)",
               "Scheduler.update_from_output (scheduler.py)", "GPUModelRunner._prepare_inputs (gpu_model_runner.py)",
               "GPUModelRunner.sample_tokens (gpu_model_runner.py)")
"""The engine core's busy loop by its parts: the model's step (the GPU's launch and wait inside it), scheduling, taking
the step's output, laying out the inputs, sampling."""


def _stacks(path: Path) -> tuple[int, int, dict[str, float]]:
    """(the busy loop's samples, the input and output threads' samples, the share of the loop's samples in each of
    :data:`STACK_PARTS`)."""
    threads, functions = summary(load(path), top=200)
    main = next((n for name, n in threads.items() if name.startswith("MainThread")), 0)
    shares = dict(functions)
    return main, sum(threads.values()) - main, {part: shares.get(part, 0.0) for part in STACK_PARTS}


def harvest_h200_engine_stacks() -> str:
    """The 48-token capacity passes of run 29 at 256 and 512 in flight: vLLM's rate beside py-spy's samples of its
    engine core (100 a second over the level's 12 s; those of a thread waiting on a lock or a socket are not taken)."""
    lines = [("| pass | in flight | vLLM's counter, tokens/s | busy loop samples (input + output threads) | "
              "model step | schedule | take output | lay out inputs | sample |"), "|---|---|---|---|---|---|---|---|---|"]
    for level in (256, 512):
        for name, tag in PASSES:
            rate = _steady(mix_phase(SESSION11, "run29", 48, f"capacity-{tag}{level}"))
            main, others, shares = _stacks(SESSION11 / "run29" / "pyspy" / f"mix-48-capacity-{tag}{level}.txt.gz")
            lines.append(f"| {name} | {level} | {rate:.0f} | {main} ({others}) | "
                         + " | ".join(f"{shares[p]:.1%}" for p in STACK_PARTS) + " |")
    return "\n".join(lines)


def harvest_h200_pace_rounds() -> str:
    """Five 48-token capacity passes back to back after run 29 (``harvest_h200.sh drift``: ``harvest.py --parts a``
    each), vLLM put to sleep and woken before the third; nothing else ran."""
    lines = ["| round | requests in flight: 128 | 256 | 512 |", "|---|---|---|---|"]
    slept = (SESSION11 / "drift" / "drift.txt").read_text()
    for n in range(1, 6):
        rates = [_steady(mix_phase(SESSION11 / "drift", str(n), 48, f"capacity-{level}")) for level in (128, 256, 512)]
        mark = " (after a sleep and a wake)" if f"round {n}: after a sleep" in slept else ""
        lines.append(f"| {n}{mark} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")
    return "\n".join(lines)


def _passes_around(got: dict[str, Any], profile: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The capacity passes right before and right after a row of run 29 (``--bracket-rows``: fleet, then longtail)."""
    if profile == "fleet":
        return got["capacity"], got["capacity_between"]["fleet"]
    return got["capacity_between"]["fleet"], got["capacity_after"]


def harvest_h200_around_session11() -> str:
    """Each row of run 29 over two readings of the server around it (the client's steady rate): the issue's, the best
    level of the best pass (each row's ``serving_vs_capacity``), and the best level of the two passes averaged level by
    level — the server's pace while the row ran, as well as two passes can tell it. The first is the figure the issue
    asks for; the second says how much of the gap to it is the server's own pace."""
    lines = [("| mix, profile | best level of the best pass, tokens/s | best level of the two averaged | "
              "serving / idle over the first | serving / idle over the second |"), "|---|---|---|---|---|"]
    got = json.loads((SESSION11 / "run29" / "harvest.json").read_text())["mixes"]
    for mix in ("512", "48"):
        for profile in ("fleet", "longtail"):
            r = json.loads((SESSION11 / "run29" / f"row-{mix}-{profile}.json").read_text())
            before, after = _passes_around(got[mix], profile)
            mean = max((a["steady_tokens_per_s"] + b["steady_tokens_per_s"]) / 2 for a, b in zip(before, after))
            ref = r["capacity_tokens_per_s"]
            serving, idle = r["serving_vs_capacity"] * ref, r["idle_vs_capacity"] * ref
            lines.append(f"| {mix}, {profile} | {ref:.0f} | {mean:.0f} | {serving / ref:.3f} / {idle / ref:.3f} | "
                         f"{serving / mean:.3f} / {idle / mean:.3f} |")
    return "\n".join(lines)


def _window_corr(samples: list[dict[str, Any]], every: int = 8) -> float | None:
    """The correlation between the probe's pace and vLLM's step length over windows of ``every`` samples (0.8 s)."""
    pace, step = [], []
    for a, b in zip(samples[::every], samples[every::every]):
        speeds = [s["cpu_speed"] for s in samples if a["t"] <= s["t"] <= b["t"] and s.get("cpu_speed")]
        if speeds and b["itl_count"] > a["itl_count"]:
            pace.append(sum(speeds) / len(speeds))
            step.append((b["itl_sum"] - a["itl_sum"]) / (b["itl_count"] - a["itl_count"]))
    return statistics.correlation(pace, step) if len(pace) > 2 else None


def harvest_h200_step_length() -> str:
    """Three 48-token capacity rounds at the end of the session (``drift``, ``CPU_PROBE=15``: the pace probe on one of
    the engine core's two CPUs): vLLM's rate over each level's middle half beside the step length its inter-token
    latency gives, the tokens a step made, and how the probe's pace and the step length moved together inside the
    level (``harvest_h200.sh drift`` each round a probe of its own: paces compare within a round only)."""
    lines = [("| round | in flight | vLLM's counter, tokens/s | running (mean) | step, ms (inter-token latency) | "
              "tokens a step | pace vs step length, correlation over 0.8 s windows |"), "|---|---|---|---|---|---|---|"]
    for label, folder, run in (("1", "a", "1"), ("2", "b", "1"), ("3", "b", "2")):
        for level in (256, 512):
            samples = mix_phase(SESSION11 / "probe" / folder, run, 48, f"capacity-{level}")
            rate, running, step, _ = reading(samples)
            corr = _window_corr(samples[len(samples) // 8: 7 * len(samples) // 8])
            lines.append(f"| {label} | {level} | {rate:.0f} | {running:.0f} | {step:.2f} | "
                         f"{rate * step / 1000:.0f} | {'–' if corr is None else f'{corr:.2f}'} |")
    return "\n".join(lines)
