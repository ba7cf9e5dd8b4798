"""How many lines the feeder keeps in flight: enough that vLLM's running batch is full and a short queue waits inside
vLLM (so a wake-up starts at full batch), never more than the ceiling. Pure: vLLM's ``/metrics`` text in, a number
out; the feeder samples and applies it.

* **No queue inside vLLM** while we use our whole limit: the server could take more — grow by half (a slow start
  that reaches 512 from 32 in seven samples).
* **A queue longer than wanted**: the server is full (``max_num_seqs`` or its KV cache): shrink to what it runs plus
  the wanted queue.
* **KV cache nearly full** with requests waiting: hold (more would only wait or be preempted).
* Without metrics (not vLLM, or they cannot be read) the limit stays where it is.

The wanted queue is ``max(min_queue, queue_fraction × running)``: a few requests per free slot the moment one frees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""vLLM's names (the second: releases before 0.10)."""


@dataclass(frozen=True)
class Sample:
    running: float
    waiting: float
    kv_usage: float | None = None
    """0..1; None: not reported."""


@dataclass(frozen=True)
class Policy:
    start: int = 32
    ceiling: int = 1024
    floor: int = 1
    min_queue: int = 4
    queue_fraction: float = 0.1
    kv_full: float = 0.98
    growth: float = 1.5
    busy: float = 0.9
    """We use our limit when at least this share of it is in flight: only then can the limit be what holds vLLM back."""

    def wanted_queue(self, running: float) -> int:
        return max(self.min_queue, math.ceil(self.queue_fraction * running))


def parse_metrics(text: str) -> Sample | None:
    """Running and waiting requests (summed over the server's engines and models) and KV-cache usage (their mean)
    from vLLM's Prometheus text; None when the text has no request gauges."""
    sums = {"running": 0.0, "waiting": 0.0}
    kv: list[float] = []
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if not math.isfinite(value):
            continue
        if name in RUNNING:
            sums["running"] += value
            seen = True
        elif name in WAITING:
            sums["waiting"] += value
            seen = True
        elif name in KV_USAGE:
            kv.append(value)
    if not seen:
        return None
    return Sample(sums["running"], sums["waiting"], sum(kv) / len(kv) if kv else None)


def next_limit(limit: int, inflight: int, sample: Sample | None, policy: Policy) -> int:
    """The limit after one sample (``inflight``: our lines out now)."""
    if sample is None:
        return max(policy.floor, min(policy.ceiling, limit))
    want = policy.wanted_queue(sample.running)
    if sample.waiting > 2 * want:
        new = int(sample.running) + want
    elif sample.kv_usage is not None and sample.kv_usage >= policy.kv_full and sample.waiting > 0:
        new = limit
    elif sample.waiting < want and inflight >= policy.busy * limit:
        new = max(limit + 1, math.ceil(limit * policy.growth))
    else:
        new = limit
    return max(policy.floor, min(policy.ceiling, new))


__all__ = ["Policy", "Sample", "next_limit", "parse_metrics"]
