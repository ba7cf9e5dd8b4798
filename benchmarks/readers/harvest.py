"""The harvest experiment's tables, for any of its runs: how much batch work the valleys do beside the trainer.

A GPU run (``benchmarks/harvest_h200.sh all``, one or more ``runNN/`` folders of ``benchmarks/harvest.py``) gives
``rows`` (each time-sliced row over the best capacity level of the passes right before and after it), ``bounds`` (each
row against the bounds the product is held to), ``lent`` (valleys lent and skipped, the tenant's warm-up) and ``step``
(every phase at 512 in flight: vLLM's rate, running count and step beside the CPU's pace). A CPU run
(``benchmarks/harvest_cpu.py``) gives ``service``: the batch service alone against a stand-in of known capacity.
"""

from __future__ import annotations

import json
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any, Callable

from readers.common import Run, _f, jsonl

BOUNDS = {"serving_vs_capacity": (0.90, "≥"), "idle_vs_capacity": (0.85, "≥"), "step_ratio": (1.01, "≤"),
          "wait_s_median": (0.02, "≤"), "wait_s_max": (0.2, "≤")}
"""Every time-sliced row of one run within these: the valleys give most of a dedicated vLLM, the trainer loses nothing."""
AT_512 = ("capacity-512", "service-alone", "row fleet", "capacity-after-fleet-512", "row longtail",
          "capacity-after-longtail-512")
"""A mix's phases at (about) 512 in flight, in the order they ran (a row: its valleys only)."""
MIXES = (512, 48)
PROFILES = ("fleet", "longtail")


def outside(row: dict[str, float]) -> list[str]:
    """The keys of ``row`` outside :data:`BOUNDS` (none: the row meets them all)."""
    return [k for k, (bound, sign) in BOUNDS.items() if (row[k] < bound if sign == "≥" else row[k] > bound)]


def _parts(run: Run) -> dict[str, str]:
    """``{runNN: code}``: the harvest.py calls of a GPU run, with the commit each ran (``?`` where not recorded)."""
    codes = run.manifest.get("code") or {}
    found = sorted(p.name for p in run.data.glob("run*") if p.is_dir())
    return {name: codes.get(name, "?") for name in found}


def _row(run: Run, part: str, mix: int, profile: str) -> dict[str, Any]:
    return json.loads((run.data / part / f"row-{mix}-{profile}.json").read_text())


def rows(run: Run) -> str:
    """Time-sliced rows over the best steady capacity level of the passes around them, with each row's limit moves
    (its ``batch.log``) and sends shed."""
    lines = ["| run (code) | mix | capacity steady best, before / after (c), tokens/s | service alone (b) / ref | "
             "profile | serving / ref | idle / ref | step ratio | wait median / max s | a valley's tokens/s, "
             "lowest–highest | limit moves, sends shed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for part, code in _parts(run).items():
        for row_path in sorted((run.data / part).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            ref = r["capacity_tokens_per_s"]
            rates = [v["tokens_per_s"] for v in r["valleys"]]
            log = run.data / part / f"mix-{r['mix_tokens']}" / r["profile"] / "auto" / "batch.log"
            moves = sum(" in flight " in x and " -> " in x for x in log.read_text().splitlines())
            lines.append(f"| {part[3:]} ({code}) | {r['mix_tokens']} | {r['capacity_before']:.0f} / "
                         f"{r['capacity_after']:.0f} | {_f(r['service_alone_tokens_per_s'] / ref, 3)} | {r['profile']} | "
                         f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | {_f(r['step_ratio'], 4)} | "
                         f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {min(rates):.0f}–{max(rates):.0f} | "
                         f"{moves}, {r['feeder']['shed']} of {r['feeder']['sent']} |")
    return "\n".join(lines)


def bounds(run: Run) -> str:
    """Each row against :data:`BOUNDS`: over its own reference and over the best pass of its whole harvest.py call."""
    lines = ["| run | mix | profile | serving / ref | idle / ref | over the run's best pass | step ratio | "
             "wait median / max s | outside the bounds |", "|---|---|---|---|---|---|---|---|---|"]
    for part in _parts(run):
        for mix in MIXES:
            for profile in PROFILES:
                r = _row(run, part, mix, profile)
                lines.append(f"| {part[3:]} | {mix} | {profile} | {_f(r['serving_vs_capacity'], 3)} | "
                             f"{_f(r['idle_vs_capacity'], 3)} | {_f(r['serving_vs_all_passes'], 3)} / "
                             f"{_f(r['idle_vs_all_passes'], 3)} | {_f(r['step_ratio'], 4)} | "
                             f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | "
                             f"{', '.join(outside(r)) or 'none'} |")
    return "\n".join(lines)


def lent(run: Run) -> str:
    """Each row: vLLM's share of the trainer's idle time, valleys lent and skipped, the tenant's warm-up, the first
    skip's reason."""
    lines = ["| run | mix | profile | vLLM of idle | valleys lent / skipped | warm-up | first skip |",
             "|---|---|---|---|---|---|---|"]
    for part in _parts(run):
        for mix in MIXES:
            for profile in PROFILES:
                r = _row(run, part, mix, profile)
                auto = run.data / part / f"mix-{mix}" / profile / "auto"
                skips = [e["detail"] for e in jsonl(auto / "run.jsonl") if e.get("action") == "skip"]
                log = (auto / "agent.log").read_text()
                warm = "given up (not asleep within 10 s)" if "given up" in log else \
                    f"{log.count('warm-up ') - log.count('given up')} cycles"
                lines.append(f"| {part[3:]} | {mix} | {profile} | {_f(r['vllm_of_idle'], 3)} | {r['lent']} / "
                             f"{r['skipped']} | {warm} | {skips[0] if skips else '–'} |")
    return "\n".join(lines)


def _mean(values: list[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else float("nan")


def in_valleys(samples: list[dict[str, Any]], valleys: list[dict[str, Any]]) -> tuple[float, float, float]:
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


def reading(samples: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """Over a phase's middle half: vLLM's rate (its counter), its mean running count, its step's length in ms (its
    inter-token latency) and the CPU's pace (``cpu_rate``)."""
    mid = samples[len(samples) // 4: 3 * len(samples) // 4]
    a, b = mid[0], mid[-1]
    rate = (b["generated"] - a["generated"]) / (b["t"] - a["t"])
    step = 1000 * (b["itl_sum"] - a["itl_sum"]) / max(1.0, b["itl_count"] - a["itl_count"])
    return rate, _mean([s.get("running") for s in mid]), step, _mean([s.get("cpu_rate") for s in mid])


def _phase(run: Run, part: str, samples: list[dict[str, Any]], mix: int, phase: str) -> list[dict[str, Any]]:
    """The 100 ms samples of one phase of one mix: labelled with the mix (``mix-512/capacity-256``), or, where a run
    labelled the phases of both mixes alike, the phase's stretch in the mix's place of the run's order."""
    stretches: list[list[dict[str, Any]]] = []
    for before, r in zip([None, *samples], samples):
        if r["phase"] in (phase, f"mix-{mix}/{phase}"):
            if before is None or before["phase"] != r["phase"]:
                stretches.append([])
            stretches[-1].append(r)
    labelled = [s for s in stretches if s[0]["phase"].startswith("mix-")]
    if labelled or len(stretches) == 1:
        return (labelled or stretches)[0]
    order = json.loads((run.data / part / "harvest.json").read_text())["options"]["mixes"].split(",")
    if len(stretches) != len(order):
        raise ValueError(f"{run.name} {part}: {len(stretches)} stretches of {phase!r} for the mixes {order}")
    return stretches[order.index(str(mix))]


def step(run: Run) -> str:
    """Every phase at 512 in flight, both mixes: vLLM's rate, running count and step (over a pass's middle half, or
    over a row's valleys) and the pace probe on the engine core's CPU."""
    lines = ["| run | mix | phase (in order) | tokens/s | running | step ms | CPU pace | tokens/s per unit of pace |",
             "|---|---|---|---|---|---|---|---|"]
    for part in _parts(run):
        samples = jsonl(run.data / part / "inflight.jsonl")
        for mix in MIXES:
            for phase in AT_512:
                if phase.startswith("row "):
                    profile = phase.split()[1]
                    row = _row(run, part, mix, profile)
                    inside = [s for s in samples if s["phase"] == f"timesliced-{mix}-{profile}"]
                    pace, ms, running = in_valleys(inside, row["valleys"])
                    rate = sum(v["tokens"] for v in row["valleys"]) / sum(v["seconds"] for v in row["valleys"])
                    phase = f"{profile} row's valleys"
                else:
                    rate, running, ms, pace = reading(_phase(run, part, samples, mix, phase))
                lines.append(f"| {part[3:]} | {mix} | {phase} | {rate:.0f} | {running:.0f} | {ms:.1f} | {pace:.2f} | "
                             f"{rate / pace:.0f} |")
    return "\n".join(lines)


def service(run: Run) -> str:
    """The batch service alone against the stand-in of known capacity, this tree and the tree before beside it."""
    folder: Path = run.data
    rows_ = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    meta = json.loads((folder / "meta.json").read_text())
    lines = ["| service | lines | lines/s (stand-in: %.0f) | CPU ms/line | first tenth | last tenth | peak RSS MiB |"
             % meta["standin_capacity_lines_per_s"], "|---|---|---|---|---|---|---|"]
    for r in rows_:
        label = "before (38d0fd7)" if r["label"] == "baseline" else "this change"
        lines.append(f"| {label} | {r['lines']} | {r['lines_per_s']:.0f} | {r['cpu_ms_per_line']:.3f} | "
                     f"{r['cpu_ms_per_line_first_tenth']:.3f} | {r['cpu_ms_per_line_last_tenth']:.3f} | "
                     f"{r['peak_rss_mib']:.0f} |")
    if "upload" in meta:
        u = meta["upload"]
        lines.append(f"\nA {u['file_mb']:.0f} MB upload (50 000 lines) and its batch: the service's RSS "
                     f"{u['rss_before_mib']:.0f} → peak {u['rss_peak_mib']:.0f} → after {u['rss_after_mib']:.0f} MiB.")
    return "\n".join(lines)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    """The tables ``run`` has: a CPU run its service table, a GPU run its rows, bounds, valleys lent and steps."""
    if (run.data / "rows.jsonl").exists():
        return {"service": service}
    return {"rows": rows, "bounds": bounds, "lent": lent, "step": step}
