"""When each open batch should end: pure, table-tested (``tests/test_batch_eta.py``); the caller says what time it is.

The service sends lines only while its gate is open (the trainer's idle valleys), so a batch's end depends on two
figures the service measures itself over a recent window (:class:`Meter`): how fast it answers while the gate is
open and work waits (tokens, else lines, per open second) and how much of the wall time the gate is open (the
valley share). Their product is the service's speed in wall time. A batch's remaining work is its lines left times
its own tokens per line so far (a batch with none answered yet: the service's recent mean), and the work ahead of it
counts as the claim orders it (:mod:`~timeslice_verl.batch.share`): a higher priority all first; within a priority
the owners share the speed by weight, each owner's batches earliest deadline first, then in creation order.

No measurement yet (a cold service, or the gate shut for the whole window): no ETA, and nothing is called late.
A forecast of the valley share (the trainer's valley forecast) would take the measured share's place through
:meth:`Rate.with_share`; the node's agent does not publish one to the service today, so the share is measured.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

WINDOW_S = 300.0
"""How far back the measurement reaches: valleys come and go within it, the speed may drift over longer."""
MIN_OPEN_S = 5.0
"""Open seconds with work waiting the speed must rest on before it is trusted."""
MIN_SPAN_S = 30.0
"""Wall seconds the valley share must rest on before it is trusted (a few valleys and peaks)."""


class Basis(str, enum.Enum):
    """What an ETA rests on: ``tokens`` (generated tokens per open second), ``lines`` (answers per open second: the
    tenant reports no usage), ``cold`` (no measurement yet), ``ended`` (the batch has ended)."""

    tokens = "tokens"
    lines = "lines"
    cold = "cold"
    ended = "ended"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Sample:
    """The service's counters at one moment (``at``: seconds on the sampler's clock)."""

    at: float
    open_s: float
    """Seconds the gate has been open in all."""
    tokens: int
    """Tokens its answers generated in all."""
    lines: int
    """Lines completed in all (failed ones are left out: a window's end fails many at once, without a request)."""
    backlog: int
    """Lines queued or in flight."""


@dataclass(frozen=True)
class Rate:
    """The measured speed: per open second while work waited, and the share of wall time the gate was open."""

    tokens_per_open_s: float
    lines_per_open_s: float
    open_share: float
    tokens_per_line: float | None
    """The recent mean over every batch (None: no usage reported)."""
    window_s: float
    """Wall seconds the share rests on."""

    @property
    def basis(self) -> Basis:
        return Basis.tokens if self.tokens_per_line else Basis.lines

    def per_wall_s(self) -> float:
        """Work (tokens, or lines: :attr:`basis`) done per wall second."""
        speed = self.tokens_per_open_s if self.basis is Basis.tokens else self.lines_per_open_s
        return speed * self.open_share

    def with_share(self, share: float | None) -> Rate:
        """This rate with another valley share (a forecast the service can see), if given."""
        if share is None or not 0.0 <= share <= 1.0:
            return self
        return Rate(self.tokens_per_open_s, self.lines_per_open_s, share, self.tokens_per_line, self.window_s)


class Meter:
    """The recent :class:`Sample` s of one service and the :class:`Rate` they give."""

    def __init__(self, window_s: float = WINDOW_S, min_open_s: float = MIN_OPEN_S,
                 min_span_s: float = MIN_SPAN_S) -> None:
        self.window_s, self.min_open_s, self.min_span_s = window_s, min_open_s, min_span_s
        self.samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        """One more sample (an older one than the last, or counters that went back — a restart — start over)."""
        last = self.samples[-1] if self.samples else None
        if last is not None and (sample.at < last.at or sample.open_s < last.open_s or sample.tokens < last.tokens
                                 or sample.lines < last.lines):
            self.samples.clear()
        self.samples.append(sample)
        while len(self.samples) > 2 and self.samples[1].at <= sample.at - self.window_s:
            self.samples.popleft()

    def rate(self) -> Rate | None:
        """The speed over the window, or None while it rests on too little (see :data:`MIN_OPEN_S`)."""
        span = opened = busy_open = tokens = lines = 0.0
        pairs = list(zip(self.samples, list(self.samples)[1:]))
        for a, b in pairs:
            span += b.at - a.at
            opened += b.open_s - a.open_s
            if a.backlog > 0 and b.backlog > 0:  # work waited throughout: the speed, not the arrivals
                busy_open += b.open_s - a.open_s
                tokens += b.tokens - a.tokens
                lines += b.lines - a.lines
        if span < self.min_span_s or busy_open < self.min_open_s or lines <= 0:
            return None
        return Rate(tokens / busy_open, lines / busy_open, min(1.0, opened / span),
                    tokens / lines if tokens > 0 else None, span)


@dataclass(frozen=True)
class Work:
    """An open batch as the estimate sees it."""

    id: str
    priority: int
    owner: str
    seq: int
    deadline: float
    left: int
    """Lines queued or in flight."""
    answered: int = 0
    """Lines completed so far (the tokens are theirs)."""
    tokens: int = 0
    """Tokens its answers generated so far."""
    weight: float = 1.0


def cost(work: Work, rate: Rate) -> float:
    """``work``'s remaining work in :attr:`Rate.basis` units: its lines left times its own mean so far, else the
    service's."""
    if rate.basis is Basis.lines:
        return float(work.left)
    mean = work.tokens / work.answered if work.answered > 0 and work.tokens > 0 else rate.tokens_per_line or 0.0
    return work.left * mean


def estimate(batches: list[Work], rate: Rate | None) -> dict[str, float]:
    """Seconds from now until each batch ends, the work ahead of it counted; {} when there is no measurement or the
    gate was never open in the window."""
    if rate is None or rate.per_wall_s() <= 0:
        return {}
    speed, now, out = rate.per_wall_s(), 0.0, {}
    levels = sorted({b.priority for b in batches}, reverse=True)
    for level in levels:
        owners: dict[str, list[list]] = {}
        for b in sorted((b for b in batches if b.priority == level), key=lambda b: (b.deadline, b.seq)):
            owners.setdefault(b.owner, []).append([b.id, cost(b, rate), max(b.weight, 1e-9)])
        while owners:
            for name in [o for o, q in owners.items() if q and q[0][1] <= 0]:  # nothing left: ends now
                out[owners[name].pop(0)[0]] = now
                if not owners[name]:
                    del owners[name]
            if not owners:
                break
            total_w = sum(q[0][2] for q in owners.values())
            # the owner whose current batch ends first at its share of the speed
            step = min(q[0][1] / (speed * q[0][2] / total_w) for q in owners.values())
            now += step
            for q in owners.values():
                q[0][1] -= step * speed * q[0][2] / total_w
                if q[0][1] <= 1e-9 * max(1.0, speed):
                    q[0][1] = 0.0
    return out


def late(eta_s: float | None, now: float, deadline: float) -> bool | None:
    """Whether a batch estimated to end ``eta_s`` from ``now`` misses its ``deadline`` (None: no estimate)."""
    if eta_s is None or not math.isfinite(eta_s):
        return None
    return now + eta_s > deadline


__all__ = ["Basis", "MIN_OPEN_S", "MIN_SPAN_S", "Meter", "Rate", "Sample", "WINDOW_S", "Work", "cost", "estimate",
           "late"]
