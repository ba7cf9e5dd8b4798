"""Tables of harvest runs 32 and 33 (one H200, 2026-12-03, the fourteenth session): the tenant a random model of
Qwen2-7B's shape (``benchmarks/tenant_model.py``) instead of the 1.36 B test model. The rows, each over the best level
of the better of the capacity passes right before and after it; each row's valleys lent and why not; vLLM's step
beside the CPU's pace in every phase at 512 in flight, which shows the 512-token mix's step steady and the 48-token
mix's rate following the host's pace. Data: benchmarks/results/2026-12-03-h200-harvest-session14/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from figures_common import RESULTS, _f, jsonl
from figures_harvest import _bracketed_rows
from figures_session13 import phase_readings

SESSION14 = RESULTS / "2026-12-03-h200-harvest-session14"
SESSION14_CODE = {"run32": "6873eba", "run33": "6873eba"}
AT_512 = ("capacity-512", "service-alone", "row fleet", "capacity-after-fleet-512", "row longtail",
          "capacity-after-longtail-512")
"""A mix's phases at (about) 512 in flight, in the order they ran (a row: its valleys only)."""


def harvest_h200_session14() -> str:
    """Runs 32 and 33: both mixes in one harvest.py each, a 7 B tenant, the engine core pinned, the service starting at
    512 in flight; each row over the best level of the better of the passes right before and right after it."""
    return _bracketed_rows(SESSION14, SESSION14_CODE)


def harvest_h200_lent_session14() -> str:
    """Each row's share of the trainer's idle time that went to vLLM, its valleys lent and skipped, the tenant's
    warm-up (its agent's log) and the first skip's reason. Run 32's first row is the one where the warm-up gave up."""
    return lent_table(SESSION14, SESSION14_CODE)


def lent_table(folder: Path, runs: Iterable[str]) -> str:
    """Each row of ``runs`` (names of run folders under ``folder``): vLLM's share of idle, valleys lent and skipped,
    the tenant's warm-up, the first skip's reason."""
    lines = ["| run | mix | profile | vLLM of idle | valleys lent / skipped | warm-up | first skip |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        for mix in (512, 48):
            for profile in ("fleet", "longtail"):
                r = json.loads((folder / run / f"row-{mix}-{profile}.json").read_text())
                auto = folder / run / f"mix-{mix}" / profile / "auto"
                skips = [e["detail"] for e in jsonl(auto / "run.jsonl") if e.get("action") == "skip"]
                log = (auto / "agent.log").read_text()
                warm = "given up (not asleep within 10 s)" if "given up" in log else \
                    f"{log.count('warm-up ') - log.count('given up')} cycles"
                lines.append(f"| {run[3:]} | {mix} | {profile} | {_f(r['vllm_of_idle'], 3)} | {r['lent']} / "
                             f"{r['skipped']} | {warm} | {skips[0] if skips else '–'} |")
    return "\n".join(lines)


def harvest_h200_step_session14() -> str:
    """Every phase at 512 in flight, both mixes, both runs: vLLM's rate, running count and step (over a pass's middle
    half, or over a row's valleys) and the pace probe on the engine core's CPU 15. The 512-token mix's step stayed
    within 15.5–18.2 ms; the 48-token mix's passes spread 18 177–27 831 tokens/s, the highest beside the probe's highest reading (7.01)."""
    return step_table(SESSION14, SESSION14_CODE)


def step_table(folder: Path, runs: Iterable[str]) -> str:
    """Every phase at 512 in flight of ``runs`` under ``folder``, both mixes: rate, running, step, CPU pace."""
    lines = ["| run | mix | phase (in order) | tokens/s | running | step ms | CPU pace | tokens/s per unit of pace |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for mix in (512, 48):
            for phase, rate, running, step, pace in phase_readings(folder, run, mix, AT_512):
                lines.append(f"| {run[3:]} | {mix} | {phase} | {rate:.0f} | {running:.0f} | {step:.1f} | {pace:.2f} | "
                             f"{rate / pace:.0f} |")
    return "\n".join(lines)
