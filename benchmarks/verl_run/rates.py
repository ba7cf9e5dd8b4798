"""The rollout's own generation rate with the tenant awake and asleep, from vLLM's throughput lines and the timeline.

verl's rollout vLLM (``actor_rollout_ref.rollout.disable_log_stats=False``) logs every ``VLLM_LOG_STATS_INTERVAL`` s
``Avg generation throughput: X tokens/s, Running: N reqs`` over the interval just past, in local time with whole
seconds; Ray forwards those lines into verl.log. The timeline has each tenant's wake (``tenant_reclaim``, awake from
its end) and yield (``tenant_yield``, asleep from its start). A window counts as "beside the tenant" when some
tenant was awake for at least half of it, and only windows where the rollout was generating count at all.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any, Iterable

STATS_RE = re.compile(
    r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[[^\]]*\] (?:Engine \d+: )?Avg prompt throughput: ([0-9.]+) tokens/s, "
    r"Avg generation throughput: ([0-9.]+) tokens/s, Running: (\d+) reqs")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
"""Colour codes a logger may put around the level, the time or the file."""
AWAKE_SHARE = 0.5


def offset(text: str) -> dt.timezone:
    """``date +%z`` (``+0100``) as a timezone; UTC when absent or malformed."""
    m = re.fullmatch(r"([+-])(\d\d)(\d\d)", text or "")
    if not m:
        return dt.timezone.utc
    minutes = int(m.group(2)) * 60 + int(m.group(3))
    return dt.timezone(dt.timedelta(minutes=minutes if m.group(1) == "+" else -minutes))


def stats_lines(log: str, year: int, tz: dt.timezone) -> list[dict[str, float]]:
    """Each throughput line: ``t`` (epoch s, the middle of its logged second), ``gen`` and ``prompt`` tokens/s, ``running``."""
    out = []
    for m in STATS_RE.finditer(ANSI_RE.sub("", log)):
        month, day, hour, minute, second = (int(g) for g in m.groups()[:5])
        t = dt.datetime(year, month, day, hour, minute, second, tzinfo=tz).timestamp() + 0.5
        out.append({"t": t, "prompt": float(m.group(6)), "gen": float(m.group(7)), "running": float(m.group(8))})
    return out


def awake_windows(records: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """When any tenant was awake: per tenant from a wake's end to its next yield's start, merged over tenants."""
    per: dict[str, list[tuple[float, float]]] = {}
    since: dict[str, float] = {}
    trans = sorted((r for r in records if r.get("hook") == "transition" and r.get("ok", True)
                    and r.get("action") in ("tenant_reclaim", "tenant_yield")), key=lambda r: r["start"])
    for r in trans:
        who = r.get("subject", "")
        if r["action"] == "tenant_reclaim":
            since.setdefault(who, r["end"])
        else:
            start = since.pop(who, float("-inf") if who not in per else None)
            if start is not None:
                per.setdefault(who, []).append((start, r["start"]))
            per.setdefault(who, [])
    for who, start in since.items():
        per.setdefault(who, []).append((start, float("inf")))
    merged: list[tuple[float, float]] = []
    for a, b in sorted(w for ws in per.values() for w in ws):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _overlap(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in windows)


def rollout_rates(lines: list[dict[str, float]], awake: list[tuple[float, float]], interval_s: float) -> dict[str, Any]:
    """Mean generation tokens/s of the rollout's busy windows, asleep vs awake tenant, and how many windows each."""
    alone: list[float] = []
    beside: list[float] = []
    for line in lines:
        if line["running"] <= 0 and line["gen"] <= 0:
            continue  # the rollout idle (paused for a weight sync, or done): not its rate
        share = _overlap(line["t"] - interval_s, line["t"], awake) / interval_s
        (beside if share >= AWAKE_SHARE else alone).append(line["gen"])

    def mean(v: list[float]) -> float | None:
        return round(sum(v) / len(v), 1) if v else None

    return {"rollout_tok_s": mean(alone + beside), "rollout_tok_s_tenant_asleep": mean(alone),
            "rollout_tok_s_tenant_awake": mean(beside), "rollout_windows": [len(alone), len(beside)]}


def awake_seconds(awake: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds some tenant was awake between ``start`` and ``end``."""
    return round(_overlap(start, end, awake), 1)


__all__ = ["awake_seconds", "awake_windows", "offset", "rollout_rates", "stats_lines"]
