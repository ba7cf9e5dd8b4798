"""One row of the validated-run table from a run's folder, or the table of several.

usage: python summarize.py OUT [OUT...] [--write]
Reads verl.log (verl's console logger), timeline.jsonl (the timeline plugin), load.json (the batch
client), run.json; ``--write`` also saves each row as OUT/row.json. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from timeslice_verl.analysis import summary, trainer_waits

STEP_RE = re.compile(r"step:(\d+) - (.*)")
GLOBAL_STEP_RE = re.compile(r"global_steps: (\d+) local_trigger_step")
SYNC_RE = re.compile(r"timing_s/param_sync: ([0-9.]+) seconds self.current_param_version: (\d+)")
FINAL_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean", "critic/score/mean")


def verl_steps(log: str) -> dict[int, dict[str, float]]:
    """verl's console lines ``step:N - key:value - …`` merged per step."""
    steps: dict[int, dict[str, float]] = {}
    for match in STEP_RE.finditer(log):
        fields = steps.setdefault(int(match.group(1)), {})
        for part in match.group(2).split(" - "):
            key, _, value = part.rpartition(":")
            try:
                fields[key.strip()] = float(value)
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


def row(out: Path) -> dict[str, Any]:
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    log = (out / "verl.log").read_text(errors="replace") if (out / "verl.log").exists() else ""
    steps = verl_steps(log)
    trained = {n: f for n, f in steps.items() if "timing_s/step" in f or "actor/pg_loss" in f}
    last = trained[max(trained)] if trained else {}
    records = _records(out / "timeline.jsonl")
    load = json.loads((out / "load.json").read_text()) if (out / "load.json").exists() else {}
    return {
        "mode": run.get("mode", out.name) + (f" ({swap(records)})" if swap(records) else ""),
        "rc": run.get("rc"),
        "steps": len(set(GLOBAL_STEP_RE.findall(log))),
        "step_s_median": _med([f["timing_s/step"] for f in trained.values() if "timing_s/step" in f]),
        "param_sync_s_median": _med([float(t) for t, version in SYNC_RE.findall(log) if int(version) > 0]),
        **timeline_figures(records),
        "batch_completed": load.get("completed"),
        "batch_failed": _failed(load),
        "batch_retried": load.get("retried") if load else None,
        "final": {k: last[k] for k in FINAL_KEYS if k in last},
    }


def _cell(value: Any) -> str:
    if value is None:
        return "–"
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
    args = parser.parse_args()
    rows = []
    for out in args.outs:
        r = row(out)
        if args.write:
            (out / "row.json").write_text(json.dumps(r, indent=1))
        rows.append(r)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
