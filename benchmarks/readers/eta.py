"""The ETA experiment's table, for any of its runs (``benchmarks/eta.py``): how far each batch's ETA was from when it
really ended, as a share of the time it then still had to run, read at points of its life."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

from readers.common import Run, jsonl

POINTS = (0.0, 0.25, 0.5, 0.75)
"""Where in a batch's life (from its creation to its end) its ETA is read."""
MIN_LEFT_S = 20.0
"""A reading this close to the batch's end is left out: a few seconds off would weigh as a large share."""
GOAL = 15.0


def _errors(folder: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each completed batch's readings at :data:`POINTS`: the ETA's error as a share of the time left (signed:
    positive when the ETA was later than the end), and counts of what was left out."""
    batches = {b["id"]: b for b in jsonl(folder / "batches.jsonl") if b.get("status") == "completed"}
    readings: dict[str, list[dict[str, Any]]] = {}
    for o in jsonl(folder / "observations.jsonl"):
        if o["id"] in batches and o["status"] == "in_progress":
            readings.setdefault(o["id"], []).append(o)
    out, counts = [], {"batches": len(batches), "cold": 0}
    for bid, b in batches.items():
        seen = readings.get(bid, [])
        start, end = b["created_at"], b["ended_at"]
        for point in POINTS:
            when = start + point * (end - start)
            near = [o for o in seen if end - o["at"] >= MIN_LEFT_S]
            if not near:
                continue
            o = min(near, key=lambda o: abs(o["at"] - when))
            if o.get("eta_at") is None:
                counts["cold"] += 1
                continue
            left = end - o["at"]
            out.append({"id": bid, "point": point, "left_s": left, "error": (o["eta_at"] - end) / left * 100})
    return out, counts


def _every(folder: Path) -> list[float]:
    """The absolute error of every reading of a completed batch with :data:`MIN_LEFT_S` or more left, in %."""
    ends = {b["id"]: b["ended_at"] for b in jsonl(folder / "batches.jsonl") if b.get("status") == "completed"}
    return [abs(o["eta_at"] - ends[o["id"]]) / (ends[o["id"]] - o["at"]) * 100 for o in jsonl(folder / "observations.jsonl")
            if o["id"] in ends and o.get("eta_at") is not None and ends[o["id"]] - o["at"] >= MIN_LEFT_S]


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summary_line(folder: Path) -> str:
    errs, counts = _errors(folder)
    got = [abs(e["error"]) for e in errs]
    med = statistics.median(got) if got else float("nan")
    return (f"median |ETA error| {med:.1f} % of the time left ({len(got)} readings at 0/25/50/75 % of "
            f"{counts['batches']} completed batches' lives; goal <= {GOAL:.0f} %)")


def points(run: Run) -> str:
    """The error at each point of a batch's life: median and 90th percentile of its absolute value, the median
    signed (positive: the ETA later than the end)."""
    errs, counts = _errors(run.data)
    lines = ["| read at | readings | median abs error, % of time left | p90 | median signed | median time left, s |",
             "|---|---|---|---|---|---|"]
    for point in (*POINTS, None):
        these = [e for e in errs if point is None or e["point"] == point]
        if not these:
            continue
        absolute = [abs(e["error"]) for e in these]
        lines.append(f"| {'all four' if point is None else f'{point:.0%} of its life'} | {len(these)} | "
                     f"{statistics.median(absolute):.1f} | {_p(absolute, 0.9):.1f} | "
                     f"{statistics.median(e['error'] for e in these):+.1f} | "
                     f"{statistics.median(e['left_s'] for e in these):.0f} |")
    every = _every(run.data)
    lines.append(f"\nevery reading ({len(every)}, each {MIN_LEFT_S:.0f} s or more before its end): median "
                 f"{statistics.median(every) if every else float('nan'):.1f} %, p90 {_p(every, 0.9):.1f} %; "
                 f"{counts['batches']} batches completed, {counts['cold']} readings without an ETA (cold)")
    return "\n".join(lines)


def kinds(run: Run) -> str:
    """Every reading (:data:`MIN_LEFT_S` or more before the end) by what the ETA could not know: the batch's own
    tokens per answer (no answer yet: the service's mean stood in) and work arriving ahead of it (priority −10:
    every later batch of priority 0 went first)."""
    batches = {b["id"]: b for b in jsonl(run.data / "batches.jsonl") if b.get("status") == "completed"}
    groups: dict[str, list[float]] = {}
    for o in jsonl(run.data / "observations.jsonl"):
        b = batches.get(o["id"])
        if b is None or o.get("eta_at") is None or b["ended_at"] - o["at"] < MIN_LEFT_S:
            continue
        error = (o["eta_at"] - b["ended_at"]) / (b["ended_at"] - o["at"]) * 100
        kind = (f"priority {b['priority']}, " + ("before its first answer" if o["completed"] == 0 else
                                                 "after its first answer"))
        groups.setdefault(kind, []).append(error)
    lines = ["| readings of | readings | median abs error, % of time left | median signed |", "|---|---|---|---|"]
    lines += [f"| {kind} | {len(got)} | {statistics.median(abs(e) for e in got):.1f} | {statistics.median(got):+.1f} |"
              for kind, got in sorted(groups.items(), key=lambda kv: (-int(kv[0].split(",")[0].split()[1]), kv[0]))]
    return "\n".join(lines)


def late(run: Run) -> str:
    """Batches flagged late when made (their first reading) against how they ended."""
    first: dict[str, Any] = {}
    for o in jsonl(run.data / "observations.jsonl"):
        first.setdefault(o["id"], o)
    rows: dict[tuple[str, str], int] = {}
    for b in jsonl(run.data / "batches.jsonl"):
        flag = {True: "flagged late", False: "on time", None: "no ETA (cold)"}[first.get(b["id"], {}).get("late")]
        rows[(flag, b["status"])] = rows.get((flag, b["status"]), 0) + 1
    lines = ["| at creation | ended | batches |", "|---|---|---|"]
    lines += [f"| {flag} | {status} | {n} |" for (flag, status), n in sorted(rows.items())]
    return "\n".join(lines)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"points": points, "kinds": kinds, "late": late}
