"""One row of the validated-run table from a run's folder, or the table of several.

usage: python summarize.py OUT [OUT...] [--write] [--brief]
Reads verl.log (verl's console logger, and the rollout vLLM's throughput lines Ray forwards into it), timeline.jsonl
(the timeline plugin), load.json (the batch client), gpumem.jsonl (gpumem.py: GPU memory by process), run.json,
copy_rate.json (this GPU's own ``copy_`` rate, measured in the run's call once verl had exited);
``--write`` also saves each row as OUT/row.json. Prints a Markdown table: every column, or with ``--brief`` the
one-GPU run's figures, one row per figure and one column per run. Runs without the newer files read as before.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import gpumem
import rates
from timeslice_verl.analysis import summary, trainer_waits

STEP_RE = re.compile(r"step:(\d+) - (.*)")
GLOBAL_STEP_RE = re.compile(r"global_steps: (\d+) local_trigger_step")
PUSH_RE = re.compile(r"timeslice_ipc: version (\d+), (\d+) tensors, (\d+) bytes in ([0-9.]+) s")
SYNC_RE = re.compile(r"timing_s/param_sync: ([0-9.]+) seconds self.current_param_version: (\d+)")
NUMPY_RE = re.compile(r"np\.(?:float|int)\d+\(([^()]*)\)")
VAL_PREFIX = "val-core/"
FINAL_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean", "critic/score/mean")


def verl_steps(log: str) -> dict[int, dict[str, float]]:
    """verl's console lines ``step:N - key:value - …`` merged per step."""
    steps: dict[int, dict[str, float]] = {}
    for match in STEP_RE.finditer(log):
        fields = steps.setdefault(int(match.group(1)), {})
        for part in match.group(2).split(" - "):
            key, _, value = part.rpartition(":")
            wrapped = NUMPY_RE.fullmatch(value.strip())  # verl's validation metrics print as np.float64(…)
            try:
                fields[key.strip()] = float(wrapped.group(1) if wrapped else value)
            except ValueError:
                continue
    return steps


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def swap(records: list[dict[str, Any]]) -> str:
    """The swap mode the run's ranks parked with ('' for checkpoint)."""
    return next((r["swap"] for r in records if r.get("hook") == "handoff" and r.get("parked_bytes") and r.get("swap")), "")


def timeline_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What a timeline alone tells of a run (the trainer wait as :func:`timeslice_verl.analysis.trainer_waits`)."""
    waits = trainer_waits(records)
    trans = [r for r in records if r.get("hook") == "transition"]
    job = next((r["job"] for r in records if r.get("hook") == "timeslice_start"), None)
    freezes = [t for t in trans if t.get("action") == "freeze" and t.get("ok") and t.get("subject") == job]
    thaws = [t for t in trans if t.get("action") == "thaw" and t.get("ok") and t.get("subject") == job]
    locked = [t for t in freezes if "locked only" in t.get("detail", "") or (t.get("phases") or {}).get("checkpoint") == 0]
    moved = [t for t in freezes if t not in locked and t.get("bytes")]
    handoffs = [r for r in records if r.get("hook") == "handoff"]
    releases = [r for r in handoffs if r.get("action") == "release" and r.get("reserved_before")]
    parks = [r for r in handoffs if r.get("action") == "release" and r.get("parked_bytes")]
    unparks = [r for r in handoffs if r.get("action") == "acquire" and r.get("parked_bytes")]
    share = summary(records) if records else {}
    return {
        "steps_in_timeline": sum(1 for r in records if r.get("hook") == "pre_train_step"),
        "trainer_wait_s_median": _med(waits),
        "trainer_wait_s_max": round(max(waits), 3) if waits else None,
        "freezes": len(freezes),
        "freeze_s_median": _med([t["end"] - t["start"] for t in freezes]),
        "thaw_s_median": _med([t["end"] - t["start"] for t in thaws]),
        "checkpointed_gb_median": _med([t["bytes"] / 1e9 for t in moved]),
        "left_gb_median": _med([t["bytes"] / 1e9 for t in locked]),
        "live_gb_median": _med([r["live_bytes"] / 1e9 for r in releases]),
        "reserved_gb_before_after": (
            [_med([r["reserved_before"] / 1e9 for r in releases]), _med([r["reserved_after"] / 1e9 for r in releases])] if releases else None
        ),
        "parked_gb_median": _med([r["parked_bytes"] / 1e9 for r in parks]),
        "park_s_median": _med([r["park_s"] for r in parks]),
        "unpark_s_median": _med([r["park_s"] for r in unparks]),
        "vllm_of_run": share.get("harvested_fraction"),
        "vllm_of_idle": share.get("harvest_of_idle"),
        "failed_transitions": sum(1 for t in trans if not t.get("ok", True)),
    }


def validation(steps: dict[int, dict[str, float]]) -> list[list[float]]:
    """``[step, score]`` for each step verl logged a validation at: its first ``val-core/…/mean@N`` key."""
    seen = []
    for n in sorted(steps):
        keys = sorted(k for k in steps[n] if k.startswith(VAL_PREFIX) and "/mean@" in k)
        if keys:
            seen.append([n, round(steps[n][keys[0]], 4)])
    return seen


def pushes(out: Path, log: str) -> dict[str, Any]:
    """The engine's push per version (its line in verl's log) against the GPU's ``copy_`` rate of the same call."""
    seen = {int(v): (int(b), float(t)) for v, _, b, t in PUSH_RE.findall(log)}
    copy = json.loads((out / "copy_rate.json").read_text()) if (out / "copy_rate.json").exists() else {}
    rate = _med([b / t for b, t in seen.values() if t > 0])
    copy_rate = copy.get("bytes_per_s")
    return {
        "pushes": [[v, b, t] for v, (b, t) in sorted(seen.items())] or None,
        "push_s_median": _med([t for _, t in seen.values()]),
        "pushed_gb": round(statistics.median(b for b, _ in seen.values()) / 1e9, 3) if seen else None,
        "push_gb_s_median": round(rate / 1e9, 1) if rate else None,
        "copy_gb_s": round(copy_rate / 1e9, 1) if copy_rate else None,
        "push_of_copy": round(rate / copy_rate, 3) if rate and copy_rate else None,
    }


def one_gpu_figures(out: Path, run: dict[str, Any], log: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the one-GPU reading adds (any run): memory by role, the rollout's rate beside and without the tenant."""
    start = float(run.get("start") or next((r["time"] for r in records if "time" in r), 0.0))
    year = dt.datetime.fromtimestamp(start or 0, dt.timezone.utc).year if start else dt.date.today().year
    lines = rates.stats_lines(log, year, rates.offset(run.get("utc_offset", "")))
    awake = rates.awake_windows(records)
    times = [r["time"] for r in records if "time" in r]
    wakes = [r for r in records if r.get("hook") == "transition" and r.get("action") == "tenant_reclaim" and r.get("ok")]
    return {
        **rates.rollout_rates(lines, awake, float(run.get("stats_interval_s") or 10)),
        "tenant_wakes": len(wakes) if records else None,
        "tenant_awake_s": rates.awake_seconds(awake, min(times), max(times)) if times and awake else None,
        "memory_gib": gpumem.by_role(out / "gpumem.jsonl") or None,
        "gpu_peak_gib": gpumem.peak_used(out / "gpumem.jsonl"),
    }


def row(out: Path) -> dict[str, Any]:
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    log = (out / "verl.log").read_text(errors="replace") if (out / "verl.log").exists() else ""
    steps = verl_steps(log)
    trained = {n: f for n, f in steps.items() if "timing_s/step" in f or "actor/pg_loss" in f}
    last = trained[max(trained)] if trained else {}
    records = _records(out / "timeline.jsonl")
    load = json.loads((out / "load.json").read_text()) if (out / "load.json").exists() else {}
    step_s = [f["timing_s/step"] for f in trained.values() if "timing_s/step" in f]
    return {
        "mode": run.get("mode", out.name) + (f" ({swap(records)})" if swap(records) else ""),
        "rc": run.get("rc"),
        "gpus": run.get("gpus", 2),
        "steps": len(set(GLOBAL_STEP_RE.findall(log))),
        "step_s_median": _med(step_s),
        "step_s_mean": round(statistics.mean(step_s), 3) if step_s else None,
        "update_s_median": _med([f["timing_s/update_actor"] for f in trained.values() if "timing_s/update_actor" in f]),
        "param_sync_s_median": _med([float(t) for t, version in SYNC_RE.findall(log) if int(version) > 0]),
        **timeline_figures(records),
        "batch_completed": load.get("completed"),
        "batch_failed": _failed(load),
        "batch_retried": load.get("retried") if load else None,
        "tenant_tokens": load.get("tokens") if load else None,
        "validation": validation(steps) or None,
        "validation_runs": _validation_runs(records),
        **one_gpu_figures(out, run, log, records),
        **pushes(out, log),
        "final": {k: last[k] for k in FINAL_KEYS if k in last},
        **faults(out),
    }


def faults(out: Path) -> dict[str, Any]:
    """The faults ``faults.sh`` made (FAULTS=1) and what brought the parts back: the supervisor's starts of the tenant
    after the first, the agent's exits its loop saw."""
    made = [r["fault"] for r in _records(out / "faults.jsonl")]
    if not made:
        return {}
    tenant = (out / "tenant.log").read_text(errors="replace") if (out / "tenant.log").exists() else ""
    agent = (out / "agent.log").read_text(errors="replace") if (out / "agent.log").exists() else ""
    return {"faults": made, "tenant_restarts": max(0, tenant.count("tenant: started ") - 1),
            "agent_restarts": agent.count("agent exited: ")}


def _validation_runs(records: list[dict[str, Any]]) -> str | None:
    """The validations in the valleys the timeline reports, answered / failed (None where none was due)."""
    ends = [r for r in records if r.get("hook") == "validation_end"]
    failed = sum(1 for r in ends if r.get("error"))
    return f"{len(ends) - failed} / {failed}" if ends else None


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):  # memory by role
        return ", ".join(f"{k} {v['peak_gib']}" for k, v in value.items())
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):  # [step, score] pairs
        return ", ".join(f"{int(n)}: {v:.4g}" for n, v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k.split('/')[-1] if k != 'critic/score/mean' else 'score'}={v:.4g}" for k, v in value.items()) or "–"
    if isinstance(value, list):
        return " → ".join(_cell(v) for v in value)
    return str(value)


COLUMNS = [
    ("mode", "run"), ("steps", "steps"), ("step_s_median", "step s (median)"), ("param_sync_s_median", "weight sync s"),
    ("trainer_wait_s_median", "trainer wait s (median)"), ("trainer_wait_s_max", "(max)"), ("freezes", "freezes"),
    ("freeze_s_median", "freeze s"), ("thaw_s_median", "thaw s"), ("checkpointed_gb_median", "checkpointed GB"),
    ("left_gb_median", "left on GPU GB"), ("vllm_of_idle", "vLLM / trainer idle"),
    ("live_gb_median", "live tensors GB"), ("parked_gb_median", "parked GB"), ("park_s_median", "park s"),
    ("unpark_s_median", "unpark s"), ("reserved_gb_before_after", "reserved GB before → after"),
    ("batch_completed", "batch completions"), ("batch_failed", "failed/aborted"), ("final", "final metrics"),
]


BRIEF = [
    ("rc", "exit status"), ("steps", "trainer steps"), ("step_s_mean", "step s (mean)"), ("step_s_median", "step s (median)"),
    ("update_s_median", "update_actor s (median)"), ("rollout_tok_s_tenant_asleep", "rollout tokens/s, tenant asleep"), ("rollout_tok_s_tenant_awake", "rollout tokens/s, tenant awake"),
    ("rollout_windows", "rollout windows asleep, awake"), ("tenant_tokens", "tenant tokens served"),
    ("batch_completed", "tenant lines completed"), ("batch_failed", "tenant lines failed/lost"),
    ("validation_runs", "validations in the valleys (answered / failed)"), ("validation", "validation (step: score)"), ("memory_gib", "GPU GiB by process (peak)"), ("gpu_peak_gib", "GPU GiB used (peak)"),
    ("tenant_wakes", "tenant wakes"), ("tenant_awake_s", "tenant awake s"), ("freezes", "trainer freezes"),
    ("trainer_wait_s_median", "trainer wait s (median)"), ("trainer_wait_s_max", "trainer wait s (max)"),
    ("param_sync_s_median", "weight sync s (median)"), ("push_s_median", "engine push s (median)"),
    ("pushed_gb", "pushed GB per version"), ("push_gb_s_median", "push GB/s (median)"),
    ("copy_gb_s", "GPU copy_ GB/s (same call)"), ("push_of_copy", "push / copy_"),
    ("failed_transitions", "failed transitions"), ("final", "final metrics"),
    ("faults", "faults made"), ("tenant_restarts", "tenant restarts (supervisor)"), ("agent_restarts", "agent restarts"),
]


MEASURED_LATER = {"push_s_median", "pushed_gb", "push_gb_s_median", "copy_gb_s", "push_of_copy"}
"""Figures a run recorded before the engine reported its pushes does not have: their rows are left out there."""


def brief(rows: list[dict[str, Any]]) -> str:
    """One line per figure, one column per run: the table a one-GPU call prints last."""
    shown = [(key, label) for key, label in BRIEF
             if key not in MEASURED_LATER or any(r.get(key) is not None for r in rows)]
    lines = ["| figure | " + " | ".join(str(r.get("mode")) for r in rows) + " |", "|---|" + "---|" * len(rows)]
    lines += ["| " + label + " | " + " | ".join(_cell(r.get(key)) for r in rows) + " |" for key, label in shown]
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _failed(load: dict[str, Any]) -> int | None:
    """Batch requests that failed: the batch service's failed and lost lines (runs before it: errors and aborts)."""
    if not load:
        return None
    if "errors" in load:
        return load.get("errors", 0) + load.get("aborted", 0)
    return load.get("failed", 0) + load.get("lost", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outs", nargs="+", type=Path)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--brief", action="store_true")
    args = parser.parse_args()
    rows = []
    for out in args.outs:
        r = row(out)
        if args.write:
            (out / "row.json").write_text(json.dumps(r, indent=1))
        rows.append(r)
    print(brief(rows) if args.brief else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
