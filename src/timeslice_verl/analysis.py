"""Read a timeline JSONL: who owned the GPU when, a summary, and a picture.

Everything here is computed from the file alone (``timeslice-verl timeline plot run.jsonl``):

* **trainer** — the job holds the GPU (from a granted acquire to its release);
* **vLLM** — the tenant is awake (from a reclaim's end to the next yield's start);
* **swapping** — a transition is running (freeze, thaw, tenant yield or reclaim);
* **idle** — none of these (e.g. a released trainer not yet frozen, or no tenant).

Fractions are of the wall time between the first and the last record.
"""

from __future__ import annotations

import bisect
import collections
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from timeslice_verl.hooks.events import PREPARE_POINT, STARTUP_POINT, is_trainer_wait  # noqa: F401 (one definition of trainer wait)

CLASSES = ("trainer", "vLLM", "swapping", "idle")
COLORS = {"trainer": "#1f77b4", "vLLM": "#2ca02c", "swapping": "#ff7f0e", "idle": "#d9d9d9"}


def load(path: str | Path) -> list[dict[str, Any]]:
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from None
    if not records:
        raise ValueError(f"{path}: no records")
    # in time order: a background thread's report (the way back) can reach the file after later records
    return sorted(records, key=lambda r: float(r.get("time", r.get("end", 0.0))))  # a transition: when it ended


def percentile(values: Iterable[float], q: float) -> float | None:
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def transitions(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Agent transitions, each once, in time order."""
    seen, out = set(), []
    for r in records:
        if r.get("hook") != "transition":
            continue
        key = (r["action"], r["subject"], round(r["start"], 6))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return sorted(out, key=lambda r: r["start"])


def holding_intervals(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """When the trainer held the GPU: granted acquire → next release."""
    out, start = [], None
    handoffs = sorted((r for r in records if r.get("hook") == "handoff" and r.get("ok", True)), key=lambda r: r["time"])
    for r in handoffs:
        if r["action"] == "acquire" and start is None:
            start = r["time"]
        elif r["action"] in ("release", "crash_release") and start is not None:
            out.append((start, r["time"] - r.get("waited_s", 0.0)))
            start = None
    if start is not None:
        out.append((start, max(r["time"] for r in records)))
    return out


def release_intervals(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The trainer's release calls (freeing its caches or parking, then the agent's answer): the handoff under way,
    never idle time with no owner."""
    return [(r["time"] - r.get("waited_s", 0.0), r["time"]) for r in records
            if r.get("hook") == "handoff" and r.get("action") == "release" and r.get("ok", True)]


def park_intervals(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """When the trainer's ranks moved their tensors (park after a release began, unpark before an acquire
    returned): part of the handoff — swapping, not idle time with no owner."""
    out = []
    for r in records:
        if r.get("hook") != "handoff" or not r.get("parked_bytes") or not r.get("park_s"):
            continue
        if r.get("action") == "release":
            begin = r["time"] - r.get("waited_s", 0.0)
            out.append((begin, begin + r["park_s"]))
        elif r.get("action") == "acquire":
            out.append((r["time"] - r["park_s"], r["time"]))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def vllm_intervals(trans: list[dict[str, Any]], t0: float, t1: float) -> list[tuple[float, float]]:
    tenant = [t for t in trans if t["action"] in ("tenant_yield", "tenant_reclaim") and t.get("ok", True)]
    if not tenant:
        return []
    out, on_since = [], (t0 if tenant[0]["action"] == "tenant_yield" else None)
    for t in tenant:
        if t["action"] == "tenant_yield" and on_since is not None:
            out.append((on_since, t["start"]))
            on_since = None
        elif t["action"] == "tenant_reclaim" and on_since is None:
            on_since = t["end"]
    if on_since is not None:
        out.append((on_since, t1))
    return out


@dataclass
class Segment:
    start: float
    end: float
    cls: str


def ownership(records: list[dict[str, Any]]) -> list[Segment]:
    """Consecutive segments of GPU ownership (priority: swapping > trainer > vLLM > idle)."""
    t0 = min(r["time"] for r in records if "time" in r)
    t1 = max(r["time"] for r in records if "time" in r)
    trans = transitions(records)
    swapping = _union([(t["start"], t["end"]) for t in trans] + park_intervals(records) + release_intervals(records))
    trainer = _union(holding_intervals(records))
    vllm = _union(vllm_intervals(trans, t0, t1))
    cuts = sorted({t0, t1, *[x for iv in swapping + trainer + vllm for x in iv if t0 <= x <= t1]})

    def inside(t: float, ivs: list[tuple[float, float]], starts: list[float]) -> bool:
        i = bisect.bisect_right(starts, t) - 1  # the unioned intervals are sorted and disjoint
        return i >= 0 and t < ivs[i][1]

    starts = {name: [a for a, _ in ivs] for name, ivs in (("swapping", swapping), ("trainer", trainer), ("vllm", vllm))}

    segments: list[Segment] = []
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        mid = (a + b) / 2
        cls = ("swapping" if inside(mid, swapping, starts["swapping"]) else "trainer" if inside(mid, trainer, starts["trainer"])
               else "vLLM" if inside(mid, vllm, starts["vllm"]) else "idle")
        if segments and segments[-1].cls == cls and abs(segments[-1].end - a) < 1e-9:
            segments[-1].end = b
        else:
            segments.append(Segment(a, b, cls))
    return segments


def trainer_waits(records: list[dict[str, Any]]) -> list[float]:
    """``waited_s`` of every trainer wait (:func:`is_trainer_wait`), in order."""
    return [float(r["waited_s"]) for r in records if r.get("hook") == "handoff" and is_trainer_wait(r)]


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    segs = ownership(records)
    t0 = min(r["time"] for r in records if "time" in r)
    t1 = max(r["time"] for r in records if "time" in r)
    wall = max(t1 - t0, 1e-9)
    seconds = {c: sum(s.end - s.start for s in segs if s.cls == c) for c in CLASSES}
    trans = transitions(records)
    waits = trainer_waits(records)
    thaws = [t["end"] - t["start"] for t in trans if t["action"] == "thaw" and t.get("ok", True) and t.get("subject") == _job(records)]
    freezes = [t["end"] - t["start"] for t in trans if t["action"] == "freeze" and t.get("ok", True) and t.get("subject") == _job(records)]
    valley = wall - seconds["trainer"]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 3)

    return {
        "job": _job(records),
        "wall_s": round(wall, 3),
        "steps": sum(1 for r in records if r.get("hook") == "pre_train_step"),
        "seconds": {c: round(v, 3) for c, v in seconds.items()},
        "trainer_busy_fraction": round(seconds["trainer"] / wall, 4),
        "trainer_idle_fraction": round(1 - seconds["trainer"] / wall, 4),
        "harvested_fraction": round(seconds["vLLM"] / wall, 4),
        "harvest_of_idle": round(seconds["vLLM"] / valley, 4) if valley > 0 else 0.0,
        "swapping_fraction": round(seconds["swapping"] / wall, 4),
        "idle_fraction": round(seconds["idle"] / wall, 4),
        "handoffs": {
            a: sum(1 for r in records if r.get("hook") == "handoff" and r.get("action") == a)
            for a in ("acquire", "release", "skip", "prepare", "crash_release")
        },
        "forecast": forecast(records),
        "valleys": valleys(records),
        "transitions": {a: sum(1 for t in trans if t["action"] == a) for a in ("freeze", "thaw", "tenant_yield", "tenant_reclaim")},
        "failed_transitions": sum(1 for t in trans if not t.get("ok", True)),
        "trainer_wait_ms": {f"p{q}": ms(percentile(waits, q)) for q in (50, 90, 99)} | {"max": ms(max(waits) if waits else None)},
        "thaw_ms": {"p50": ms(percentile(thaws, 50)), "max": ms(max(thaws) if thaws else None)},
        "freeze_ms": {"p50": ms(percentile(freezes, 50)), "max": ms(max(freezes) if freezes else None)},
        "frozen_gib_max": round(max((t.get("bytes", 0) for t in trans if t["action"] == "freeze"
                                     and (t.get("phases") or {}).get("checkpoint", 1.0) > 0), default=0) / 2**30, 3),
        "swaps": dict(collections.Counter(r["swap"] for r in records if r.get("hook") == "handoff"
                                          and r.get("action") == "release" and r.get("swap"))),
        "parked_gib_max": round(max((r.get("parked_bytes", 0) for r in records if r.get("hook") == "handoff"), default=0)
                                / 2**30, 3),
    }


def forecast(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the way back was timed: ``early_ms`` — the GPUs were back before the trainer asked (an
    early forecast: they sat with the trainer unused); ``late_ms`` — the trainer's acquires that still waited."""
    handoffs = [r for r in records if r.get("hook") == "handoff"]
    early = [float(r.get("early_s", 0.0)) for r in handoffs if r.get("action") == "acquire" and r.get("early_s")]
    late = [float(r["waited_s"]) for r in handoffs if is_trainer_wait(r) and r["waited_s"] > 0]
    prepared = sum(1 for r in handoffs if r.get("action") == "prepare" or r.get("point") == PREPARE_POINT)

    def stats(values: list[float]) -> dict[str, float | None]:
        return {"n": len(values), "p50": round(percentile(values, 50) * 1e3, 3) if values else None,
                "p90": round(percentile(values, 90) * 1e3, 3) if values else None,
                "max": round(max(values) * 1e3, 3) if values else None, "total": round(sum(values) * 1e3, 3)}

    return {"prepared": prepared, "early_ms": stats(early), "late_ms": stats(late)}


def valleys(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each lent valley (a release to the next acquire) against what its round trip cost: the release, the
    agent's moves reported with the acquire (freeze, the tenant's wake and yield, thaw) and the unpark.
    ``below_break_even``: valleys that were shorter than their own round trip (lending them could not pay).
    A valley the end of the run cut short (the final acquire that brings parked ranks back) is no forecast's
    doing: ``cut_by_end`` counts it apart."""
    handoffs = [r for r in records if r.get("hook") == "handoff" and r.get("ok", True)]
    out: list[tuple[float, float]] = []
    release = None
    cut = 0
    for r in handoffs:
        if r.get("action") == "release" and r.get("point") != "timeslice_stop":
            release = r
        elif r.get("action") == "acquire" and release is not None and r.get("point") == "timeslice_stop":
            cut, release = cut + 1, None
        elif r.get("action") == "acquire" and release is not None and r.get("point") != STARTUP_POINT:
            moves = sum(float(t["end"]) - float(t["start"]) for t in r.get("transitions", [])
                        if t.get("action") in ("freeze", "thaw", "tenant_yield", "tenant_reclaim"))
            valley = float(r["time"]) - float(r.get("waited_s", 0.0)) - float(release["time"])
            out.append((valley, float(release.get("waited_s", 0.0)) + moves + float(r.get("park_s", 0.0))))
            release = None
    return {"lent": len(out), "below_break_even": sum(1 for v, trip in out if v < trip), "cut_by_end": cut,
            "valley_s_p50": round(percentile([v for v, _ in out], 50), 3) if out else None,
            "round_trip_s_p50": round(percentile([t for _, t in out], 50), 3) if out else None}


def _job(records: list[dict[str, Any]]) -> str:
    return next((r["job"] for r in records if r.get("job") and r.get("hook") != "transition"), "")



def _counts(counts: dict[str, int]) -> str:
    """``acquire 13, release 9`` — a tally for people, the zeros left out."""
    return ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"

def render_summary(s: dict[str, Any]) -> str:
    w = s["trainer_wait_ms"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return "\n".join([
        f"job {s['job']}: {s['steps']} steps in {s['wall_s']:.1f} s",
        f"  trainer held the GPU   {s['trainer_busy_fraction'] * 100:5.1f} %   (idle valleys: {s['trainer_idle_fraction'] * 100:.1f} %)",
        f"  vLLM harvested         {s['harvested_fraction'] * 100:5.1f} %   ({s['harvest_of_idle'] * 100:.1f} % of the valleys)",
        f"  swapping               {s['swapping_fraction'] * 100:5.1f} %",
        f"  idle, no owner         {s.get('idle_fraction', 0.0) * 100:5.1f} %",
        f"  trainer wait ms        p50 {fmt(w['p50'])}  p90 {fmt(w['p90'])}  p99 {fmt(w['p99'])}  max {fmt(w['max'])}",
        f"  thaw ms p50 {fmt(s['thaw_ms']['p50'])} · freeze ms p50 {fmt(s['freeze_ms']['p50'])} · "
        f"frozen up to {s['frozen_gib_max']:.2f} GiB" + (f" · parked up to {s['parked_gib_max']:.2f} GiB" if s.get("parked_gib_max") else ""),
        f"  handoffs {_counts(s['handoffs'])} · transitions {_counts(s['transitions'])} · failed {s['failed_transitions']}",
        *([f"  way back: {f['prepared']} prepared · early {f['early_ms'].get('n', '')}× ms p50 {fmt(f['early_ms']['p50'])} "
           f"p90 {fmt(f['early_ms'].get('p90'))} max {fmt(f['early_ms']['max'])} · late {f['late_ms'].get('n', '')}× ms p50 "
           f"{fmt(f['late_ms']['p50'])} p90 {fmt(f['late_ms'].get('p90'))} max {fmt(f['late_ms']['max'])}"]
          if (f := s.get("forecast")) else []),
        *([f"  swap: {', '.join(f'{k} ×{v}' for k, v in s['swaps'].items())}"] if s.get("swaps") else []),
        *([f"  valleys lent {v['lent']} (median {fmt(v['valley_s_p50'])} s; round trip {fmt(v['round_trip_s_p50'])} s)"
           f" · shorter than their round trip: {v['below_break_even']}"
           + (f" · cut short by the run's end: {v['cut_by_end']}" if v.get("cut_by_end") else "")] if (v := s.get("valleys")) else []),
    ])


def plot(records: list[dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """Draw GPU ownership over time (and the trainer's step marks) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    segs = ownership(records)
    s = summary(records)
    t0 = min(r["time"] for r in records if "time" in r)
    fig, ax = plt.subplots(figsize=(12, 3.2), dpi=110)
    for cls in CLASSES:
        bars = [(seg.start - t0, seg.end - seg.start) for seg in segs if seg.cls == cls]
        if bars:
            ax.broken_barh(bars, (1.0, 0.8), facecolors=COLORS[cls])
    holds = holding_intervals(records)
    ax.broken_barh([(a - t0, b - a) for a, b in holds], (0.2, 0.5), facecolors=COLORS["trainer"], alpha=0.45)
    for r in records:
        if r.get("hook") == "post_rollout":
            ax.plot([r["time"] - t0], [0.45], marker="v", color="black", markersize=5)
    ax.set_yticks([0.45, 1.4])
    ax.set_yticklabels(["trainer holds\n(▼ batch ready)", "GPU owner"])
    ax.set_xlabel("seconds")
    ax.set_ylim(0, 2.0)
    ax.set_xlim(0, s["wall_s"])
    ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in CLASSES], loc="upper right", ncol=4, fontsize=8, frameon=False)
    ax.set_title(
        (title + " — " if title else "")
        + f"job {s['job']}: trainer {s['trainer_busy_fraction'] * 100:.0f} %, vLLM harvested {s['harvested_fraction'] * 100:.0f} %, "
        f"swapping {s['swapping_fraction'] * 100:.0f} %, trainer wait p50 {s['trainer_wait_ms']['p50'] or 0:.0f} ms",
        fontsize=9,
    )
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
