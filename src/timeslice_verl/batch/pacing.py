"""Sends spread over an answer's time (``timeslice.batch.spread``): lines whose answers are all one length, sent
together, come back together, and a server whose front end parses, schedules and answers each request in turn
runs empty between the waves. With short answers vLLM was seen cycling in under a second between a full running
batch and a few tenths of a second at a fraction of its rate while a wave was answered and the next parsed (with
long answers, rarely). Sends released at the limit's own pace (``limit`` per answer's time, a little faster) keep the
answers spread once they are, so the front end's work overlaps the GPU's. (vLLM's front end in four processes,
``--api-server-count 4``, removes most of those waves without it; ``benchmarks/harvest.py --spread`` measures
spreading itself.) Pure: the clock comes in."""

from __future__ import annotations

import math
from dataclasses import dataclass

HEADROOM = 1.25
"""Sends are released this much faster than the limit's steady pace (``limit`` per answer's time): the pacer must
never be what holds the limit below itself, only what breaks a wave up."""
BURST_SHARE = 0.125
"""The share of the limit sent at once (at least one send)."""
LATENCY_WEIGHT = 0.05
"""Each answer's weight in the answer time's running mean (the last ~20 answers count most)."""


@dataclass
class Latency:
    """The running mean of the time from a send to its answer; None before the first answer."""

    mean_s: float | None = None

    def add(self, seconds: float) -> None:
        if seconds < 0 or not math.isfinite(seconds):
            return
        self.mean_s = seconds if self.mean_s is None else self.mean_s + LATENCY_WEIGHT * (seconds - self.mean_s)


@dataclass
class Pacer:
    """A token bucket whose rate is the limit per answer's time (× :data:`HEADROOM`) and whose depth is a share of the
    limit. Before the first answer (no answer time yet) it lets everything through."""

    tokens: float = 0.0
    at: float | None = None

    def allow(self, now: float, want: int, limit: int, answer_s: float | None) -> int:
        """How many of ``want`` sends may go now; they are taken from the bucket."""
        if want <= 0:
            return 0
        if answer_s is None or answer_s <= 0:
            return want
        depth = max(1.0, BURST_SHARE * limit)
        rate = HEADROOM * limit / answer_s
        if self.at is None:
            self.tokens = depth
        else:
            self.tokens = min(depth, self.tokens + max(0.0, now - self.at) * rate)
        self.at = now
        n = min(want, int(self.tokens))
        self.tokens -= n
        return n

    def wait_s(self, limit: int, answer_s: float | None) -> float:
        """Seconds until the next send may go (0: now)."""
        if answer_s is None or answer_s <= 0 or self.tokens >= 1.0:
            return 0.0
        return (1.0 - self.tokens) * answer_s / (HEADROOM * max(1, limit))
