"""Tables of harvest run 28 (one H200, 2026-12-03, the tenth session): its rows, the limit each valley ran at, how far
the server's capacity moved between the passes around the rows, and what vLLM's processes did in each phase.
Data: benchmarks/results/2026-12-03-h200-harvest-session10/."""

from __future__ import annotations

from typing import Any

from figures_common import RESULTS
from figures_harvest import _bracketed_rows, _phases
from figures_limits import _steady, by_limit, drift

SESSION10 = RESULTS / "2026-12-03-h200-harvest-session10"
SESSION10_CODE = {"run28": "2936ab4"}


def harvest_h200_session10() -> str:
    """Run 28: both mixes in one harvest.py, the engine core pinned (``PIN_ENGINE=1``), bracketed as in session 6."""
    return _bracketed_rows(SESSION10, SESSION10_CODE)


def harvest_h200_by_limit_session10() -> str:
    return by_limit([(SESSION10, run) for run in SESSION10_CODE])


def harvest_h200_drift_session10() -> str:
    return drift([(SESSION10, "run28", 512), (SESSION10, "run28", 48)])


def _mean(samples: list[dict[str, Any]], key: str, role: str = "") -> float:
    values = [(s["vllm_cores"].get(role, 0.0) if role else s.get(key) or 0.0) for s in samples]
    return sum(values) / len(values)


def harvest_h200_pace() -> str:
    """Each phase of run 28 with vLLM kept busy and nothing else on the GPU (capacity levels, the service alone), over
    its middle half: vLLM's own rate, how many it ran, the CPU of its engine core (pinned to two CPUs of its own) and
    of its four API servers, the GPU's utilisation, and the hypervisor's steal on the engine core's CPUs."""
    lines = [("| phase | vLLM's counter, tokens/s | running (mean) | engine core, cores | API servers, cores | "
              "GPU busy, % | steal on the engine core's CPUs |"), "|---|---|---|---|---|---|---|"]
    for phase, samples in _phases(SESSION10 / "run28" / "inflight.jsonl").items():
        if not any(k in phase for k in ("capacity", "service")):
            continue
        mid = samples[len(samples) // 4: 3 * len(samples) // 4]
        lines.append(f"| {phase} | {_steady(samples):.0f} | {_mean(mid, 'running'):.0f} | {_mean(mid, '', 'engine_core'):.2f} | "
                     f"{_mean(mid, '', 'api_server'):.2f} | {_mean(mid, 'gpu_util'):.0f} | "
                     f"{_mean(mid, 'engine_cpu_steal'):.3f} |")
    return "\n".join(lines)
