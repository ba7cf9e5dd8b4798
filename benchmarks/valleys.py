"""Valley benchmark: the same seeded fully-async schedule solo and time-sliced, side by side in one run.

    python benchmarks/valleys.py --out runs/valleys --vllm-model MODEL --gib 18 --rollout-s 20 --train-s 4 \
        --steps 12 --burst-every 4                   # a GPU machine: a real vLLM tenant, parked worker
    python benchmarks/valleys.py --out runs/valleys  # CPU: the labelled dry run

Runs ``timeslice-verl demo --solo`` (``+timeslice=observe``: the trainer keeps its GPU) and then the demo with
``+timeslice=interleave`` (the defaults, plus any ``--set``) on the same schedule and seed, against one tenant.
Prints one table: the median step time of each and their ratio, the trainer's wait at acquire (median / max),
vLLM's share of the trainer's idle time, idle time with no owner, handoffs skipped and lent, lent valleys
shorter than their own round trip, the way back (prepared, early / late), failed or aborted batch requests and
whether the worker's data survived. Writes ``valleys.json`` and each run's folder (``run.jsonl``, agent log).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from timeslice_verl.demo.run import DemoOptions, end_process, start_vllm, run_demo

KEEP = ("wall_s", "steps", "step_s_median", "harvest_of_idle", "harvested_fraction", "idle_fraction", "handoffs",
        "forecast", "valleys", "trainer_wait_ms", "failed_transitions", "batch", "worker_data_intact", "mode",
        "steps_detail", "parked_gib_max")


def row(solo: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """The comparison's figures, from the two runs' summaries."""
    wait = shared["trainer_wait_ms"]
    batch = shared.get("batch") or {}
    return {
        "steps": shared["steps"],
        "step_s_solo": round(solo["step_s_median"], 3),
        "step_s_interleave": round(shared["step_s_median"], 3),
        "step_ratio": round(shared["step_s_median"] / solo["step_s_median"], 4),
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
        "parked_gib": shared.get("parked_gib_max"),
        "batch_completed": batch.get("completed"),
        "batch_failed": (batch.get("errors", 0) + batch.get("aborted", 0)) if batch else None,
        "intact": bool(solo["worker_data_intact"] and shared["worker_data_intact"]),
    }


COLUMNS = [("steps", "steps"), ("step_s_solo", "step s solo"), ("step_s_interleave", "step s interleave"),
           ("step_ratio", "ratio"), ("wait_s_median", "trainer wait s median"), ("wait_s_max", "max"),
           ("vllm_of_idle", "vLLM / trainer idle"), ("no_owner_idle", "no-owner idle / run"), ("lent", "lent"),
           ("skipped", "skipped"), ("below_break_even", "below break-even"), ("prepared", "way back ahead"),
           ("parked_gib", "parked GiB"), ("batch_completed", "batch requests"), ("batch_failed", "failed/aborted"),
           ("intact", "data intact")]


PERCENT = ("vllm_of_idle", "no_owner_idle")


def table(r: dict[str, Any]) -> str:
    def cell(key: str, v: Any) -> str:
        if v is None:
            return "–"
        if key in PERCENT:
            return f"{v * 100:.1f} %"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return "yes" if v is True else "NO" if v is False else str(v)

    return "\n".join(["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
                      "| " + " | ".join(cell(k, r.get(k)) for k, _ in COLUMNS) + " |"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("valleys"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rollout-s", type=float, default=1.5)
    ap.add_argument("--train-s", type=float, default=0.5)
    ap.add_argument("--burst-every", type=int, default=4)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--vllm-url", default="")
    ap.add_argument("--vllm-model", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="timeslice.KEY=VALUE")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    vllm = None
    url = args.vllm_url
    if args.vllm_model:  # one tenant for both runs (it idles, unloaded, through the solo run)
        vllm, url = start_vllm(args.vllm_model, args.out)
    try:
        base = DemoOptions(steps=args.steps, rollout_s=args.rollout_s, train_s=args.train_s, device=args.device,
                           gib=args.gib, vllm_url=url, clients=args.clients, seed=args.seed,
                           burst_every=args.burst_every, overrides=tuple(args.overrides))
        solo = run_demo(replace(base, out=args.out / "solo", solo=True, overrides=()))
        shared = run_demo(replace(base, out=args.out / "interleave"))
    finally:
        if vllm is not None:
            end_process(vllm, 60)
    r = row(solo, shared)
    result = {"options": vars(args) | {"out": str(args.out)}, "row": r, "label": shared["mode"]["label"],
              "solo": {k: solo.get(k) for k in KEEP}, "interleave": {k: shared.get(k) for k in KEEP}}
    (args.out / "valleys.json").write_text(json.dumps(result, indent=1, default=str))
    print(result["label"])
    print(table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
