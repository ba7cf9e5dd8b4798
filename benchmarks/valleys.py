"""Valley benchmark: the same seeded fully-async schedules solo and time-sliced, side by side in one run.

    python benchmarks/valleys.py --out runs/valleys --vllm-model MODEL --gib 18 --rollout-s 6 --train-s 1.5 \
        --steps 12 --profiles even,fleet,longtail --modes auto,park   # a GPU machine: a real vLLM tenant
    python benchmarks/valleys.py --out runs/valleys                  # CPU: the labelled dry run

For each arrival profile (``even``: samples evenly over each batch; ``fleet``, ``longtail``: shaped like verl's
rollouter, :mod:`timeslice_verl.demo.arrivals`) it runs ``timeslice-verl demo --solo`` (``+timeslice=observe``: the
trainer keeps its GPU) and then the demo with ``+timeslice=interleave`` once per swap mode (``auto``: the defaults,
whatever ``auto`` picks on this node; or a mode named), plus any ``--set``, on the same schedule and seed, against
one tenant. The batch traffic is a batch submitted to the node's batch service in each run.
Prints one table, a row per profile and mode: the swap used, the median step time solo and shared, the ratio of the
runs' summed step times (the same seeded schedule: the trainer's cost) and of their medians, the trainer's wait at
acquire (median / max),
vLLM's share of the trainer's idle time, idle time with no owner, handoffs skipped and lent, lent valleys
shorter than their own round trip, the way back (prepared, early / late), failed or aborted batch requests and
whether the worker's data survived. Writes ``valleys.json`` and each run's folder (``run.jsonl``, agent log);
``--record benchmarks/results/valleys/DATE-MACHINE`` packs ``--out`` (one part, by its name) beside a manifest.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from readers.common import add_record_arguments, record
from timeslice_verl.demo.procs import free_port, start_vllm
from timeslice_verl.demo.run import DemoOptions, run_demo

KEEP = ("wall_s", "steps", "step_s_median", "swaps", "harvest_of_idle", "harvested_fraction", "idle_fraction", "handoffs",
        "forecast", "valleys", "trainer_wait_ms", "failed_transitions", "batch", "worker_data_intact", "mode",
        "steps_detail", "parked_gib_max")


def row(solo: dict[str, Any], shared: dict[str, Any], profile: str = "even", mode: str = "auto") -> dict[str, Any]:
    """The comparison's figures, from the two runs' summaries."""
    wait = shared["trainer_wait_ms"]
    batch = shared.get("batch") or {}
    return {
        "profile": profile, "mode": mode, "swap": _swap(mode, shared.get("swaps") or {}),
        "steps": shared["steps"],
        "step_s_solo": round(solo["step_s_median"], 3),
        "step_s_interleave": round(shared["step_s_median"], 3),
        "step_ratio": _total_ratio(solo, shared),
        "step_ratio_median": round(shared["step_s_median"] / solo["step_s_median"], 4),
        "wait_s_median": None if wait["p50"] is None else round(wait["p50"] / 1e3, 3),
        "wait_s_max": None if wait["max"] is None else round(wait["max"] / 1e3, 3),
        "vllm_of_idle": shared["harvest_of_idle"],
        "no_owner_idle": shared["idle_fraction"],
        "lent": shared["valleys"]["lent"],
        "skipped": shared["handoffs"]["skip"],
        "below_break_even": shared["valleys"]["below_break_even"],
        "prepared": shared["forecast"]["prepared"],
        "early_ms_p50": shared["forecast"]["early_ms"]["p50"],
        "late_ms_p50": shared["forecast"]["late_ms"]["p50"],
        "early_n": shared["forecast"]["early_ms"].get("n"), "late_n": shared["forecast"]["late_ms"].get("n"),
        "parked_gib": shared.get("parked_gib_max"),
        "batch_completed": batch.get("completed"),
        "batch_retried": batch.get("retried"),
        "batch_failed": _failed(batch),
        "tokens_per_gpu_s": batch.get("tokens_per_gpu_s"),
        "intact": bool(solo["worker_data_intact"] and shared["worker_data_intact"]),
    }


def _total_ratio(solo: dict[str, Any], shared: dict[str, Any]) -> float | None:
    """The time-sliced run's steps over the solo run's, summed: both ran the same seeded schedule step by step, so
    this is what time-slicing cost the trainer. A ratio of medians is shown beside it, but one step that moves
    across the middle of 12 shifts it by 2 % (longtail on the H200, 2026-12-01: 1.023 against 1.001 summed)."""
    a, b = solo.get("steps_detail") or [], shared.get("steps_detail") or []
    if not a or len(a) != len(b):
        return None
    return round(sum(s["step_s"] for s in b) / sum(s["step_s"] for s in a), 4)


def _swap(mode: str, swaps: dict[str, int]) -> str | None:
    """The swap the runs used; ``auto → resident`` where the mode left the choice to the trainer."""
    used = ", ".join(sorted(swaps)) or None
    return f"auto → {used}" if mode == "auto" and used else used


def _failed(batch: dict[str, Any]) -> int | None:
    """Batch lines failed or lost (the batch service's run); runs before it counted errors and aborts."""
    if not batch:
        return None
    if "errors" in batch:
        return batch.get("errors", 0) + batch.get("aborted", 0)
    return batch.get("failed", 0) + batch.get("lost", 0)


COLUMNS = [("profile", "arrivals"), ("swap", "swap"), ("steps", "steps"), ("step_s_solo", "step s solo"), ("step_s_interleave", "step s interleave"),
           ("step_ratio", "ratio (total)"), ("step_ratio_median", "ratio of medians"),
           ("wait_s_median", "trainer wait s median"), ("wait_s_max", "max"),
           ("vllm_of_idle", "vLLM / trainer idle"), ("no_owner_idle", "no-owner idle / run"), ("lent", "lent"),
           ("skipped", "skipped"), ("below_break_even", "below break-even"), ("prepared", "way back ahead"),
           ("early_ms_p50", "early ms p50"), ("late_ms_p50", "late ms p50"), ("parked_gib", "parked GiB"),
           ("batch_completed", "batch lines"), ("batch_retried", "retried"), ("batch_failed", "failed/lost"),
           ("tokens_per_gpu_s", "tokens/s (tenant's GPU time)"), ("intact", "data intact")]


PERCENT = ("vllm_of_idle", "no_owner_idle")


def table(rows: list[dict[str, Any]] | dict[str, Any]) -> str:
    rows = [rows] if isinstance(rows, dict) else rows

    def cell(key: str, v: Any) -> str:
        if v is None:
            return "–"
        if key in PERCENT:
            return f"{v * 100:.1f} %"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return "yes" if v is True else "NO" if v is False else str(v)

    return "\n".join(["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
                      *("| " + " | ".join(cell(k, r.get(k)) for k, _ in COLUMNS) + " |" for r in rows)])


def _mode_overrides(mode: str) -> tuple[str, ...]:
    return () if mode == "auto" else (f"timeslice.handoff.swap={mode}",)


def _profile_runs(args: argparse.Namespace, base: DemoOptions, profile: str, done: Callable[[tuple], None]) -> None:
    """The solo run of ``profile``, then one time-sliced run per mode; ``done`` gets (profile, solo, shared, mode)
    after each, so a run cut short (a machine's time limit) keeps the rows it finished."""
    folder = args.out / profile
    solo = run_demo(replace(base, out=folder / "solo", solo=True, overrides=(), profile=profile))
    for mode in args.modes.split(","):
        shared = run_demo(replace(base, out=folder / mode, profile=profile,
                                  overrides=(*_mode_overrides(mode), *base.overrides)))
        done((profile, solo, shared, mode))


def _write(args: argparse.Namespace, runs: list[tuple]) -> dict[str, Any]:
    rows = [row(solo, shared, profile, mode) for profile, solo, shared, mode in runs]
    result = {"options": vars(args) | {"out": str(args.out)}, "rows": rows, "label": runs[-1][2]["mode"]["label"],
              "runs": [{"profile": p, "mode": m, "solo": {k: solo.get(k) for k in KEEP},
                        "interleave": {k: shared.get(k) for k in KEEP}} for p, solo, shared, m in runs]}
    (args.out / "valleys.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("valleys"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rollout-s", type=float, default=1.5)
    ap.add_argument("--train-s", type=float, default=0.5)
    ap.add_argument("--burst-every", type=int, default=4, help="even schedule only")
    ap.add_argument("--profiles", default="even", help="comma-separated: even, fleet, longtail")
    ap.add_argument("--modes", default="auto", help="comma-separated swap modes: auto (the defaults), park, …")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--batch-lines", type=int, default=20000)
    ap.add_argument("--vllm-url", default="")
    ap.add_argument("--vllm-model", default="")
    ap.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[], metavar="ARG")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="timeslice.KEY=VALUE")
    add_record_arguments(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    vllm, url = None, args.vllm_url
    if args.vllm_model:  # one tenant for every run (it idles, unloaded, through the solo runs)
        vllm, url = start_vllm(args.vllm_model, args.out, free_port(), tuple(args.vllm_args))
    runs: list[tuple] = []

    def done(run: tuple) -> None:
        runs.append(run)
        _write(args, runs)

    try:
        base = DemoOptions(steps=args.steps, rollout_s=args.rollout_s, train_s=args.train_s, device=args.device,
                           gib=args.gib, vllm_url=url, clients=args.clients, seed=args.seed,
                           batch_lines=args.batch_lines, overrides=tuple(args.overrides))
        for profile in args.profiles.split(","):
            _profile_runs(args, replace(base, burst_every=args.burst_every if profile == "even" else 0), profile, done)
    finally:
        if vllm is not None:
            vllm.stop()
    result = _write(args, runs)
    rows = result["rows"]
    print(result["label"])
    print(table(rows))
    record(args, "valleys", [args.out], f"{result['label']}: " + "; ".join(
        f"{r['profile']} {r['mode']}: steps {r['step_ratio']} of solo, wait max {r['wait_s_max']} s" for r in rows),
        parts=[[args.out.name, None]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
