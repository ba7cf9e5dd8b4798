"""When each open batch should end: pure, table-tested (``tests/test_batch_eta.py``); the caller says what time it is.

The service sends lines only while its gate is open (the trainer's idle valleys), so a batch's end depends on two
figures the service measures itself over a recent window (:class:`Meter`): how fast it answers while the gate is
open and work waits (tokens, else lines, per open second) and how much of the wall time the gate is open (the
valley share). Their product is the service's speed in wall time. A batch's remaining work is its lines left times
its tokens per line (:func:`per_line`), and the work ahead of it counts as the claim orders it
(:mod:`~timeslice_verl.batch.share`): a higher priority all first; within a priority the owners share the speed by
weight, each owner's batches earliest deadline first, then in creation order.

A batch's tokens per line start from what its lines ask for (``max_tokens``: :attr:`Work.asked`) times the share of
the tokens asked that recent answers generated (:attr:`Rate.fill`: 1 with a model that writes to the limit, less
with one that stops early; not measured yet: what they ask, at most the service's recent mean), and move to its own
answers' mean as they come, weighed as :data:`PRIOR_LINES` lines against them. The service's recent mean over every
batch, which batches asking for 16 tokens and batches asking for 1024 make together, would be wrong for either: it
stands in only for a batch whose lines name no limit, until its first answer.

No measurement yet (a cold service, or the gate shut for the whole window): no ETA, and nothing is called late.
A forecast of the valley share (the trainer's valley forecast) would take the measured share's place through
:meth:`Rate.with_share`; the node's agent does not publish one to the service today, so the share is measured.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, replace

WINDOW_S = 300.0
"""How far back the measurement reaches: valleys come and go within it, the speed may drift over longer."""
MIN_OPEN_S = 5.0
"""Open seconds with work waiting the speed must rest on before it is trusted."""
MIN_SPAN_S = 30.0
"""Wall seconds the valley share must rest on before it is trusted (a few valleys and peaks)."""
PRIOR_LINES = 10.0
"""Answered lines that weigh as much as what a batch's lines ask for: a batch's first answers move its estimate
little (the first to end are the shortest), a hundred decide it."""


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
    asked: float = 0.0
    """Tokens asked for at most (``max_tokens``) by the lines completed in all, of batches whose lines name one."""
    asked_out: int = 0
    """Tokens those lines generated."""


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
    fill: float | None = None
    """Tokens generated per token asked, recently, over lines that named a limit (None: none answered)."""

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
        return replace(self, open_share=share)


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
        first, last = self.samples[0], self.samples[-1]
        asked = last.asked - first.asked  # every answer counts here, whenever it came: the tokens asked are not a speed
        fill = (last.asked_out - first.asked_out) / asked if asked > 0 else None
        return Rate(tokens / busy_open, lines / busy_open, min(1.0, opened / span),
                    tokens / lines if tokens > 0 else None, span, fill)


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
    asked: float | None = None
    """Tokens a line of it asks for at most, its lines' mean (None: they name no limit)."""


def asked_per_line(asked_tokens: int, asked_lines: int) -> float | None:
    """A batch's mean tokens asked for a line, from its counters (None: no line of it names a limit)."""
    return asked_tokens / asked_lines if asked_lines > 0 else None


def per_line(work: Work, rate: Rate) -> float:
    """The tokens a line of ``work`` left should generate: what its lines ask for times the recent :attr:`Rate.fill`
    (none measured: what they ask, at most the service's recent mean), weighed against its own answers' mean as
    :data:`PRIOR_LINES` lines; with no limit named, its own mean, else the service's."""
    own = work.tokens / work.answered if work.answered > 0 and work.tokens > 0 else None
    if work.asked is None:
        return own if own is not None else rate.tokens_per_line or 0.0
    prior = work.asked * rate.fill if rate.fill else min(work.asked, rate.tokens_per_line or work.asked)
    if own is None:
        return prior
    return (work.answered * own + PRIOR_LINES * prior) / (work.answered + PRIOR_LINES)


def cost(work: Work, rate: Rate) -> float:
    """``work``'s remaining work in :attr:`Rate.basis` units: its lines left times :func:`per_line`."""
    if rate.basis is Basis.lines:
        return float(work.left)
    return work.left * per_line(work, rate)


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


__all__ = ["Basis", "MIN_OPEN_S", "MIN_SPAN_S", "PRIOR_LINES", "Meter", "Rate", "Sample", "WINDOW_S", "Work",
           "asked_per_line", "cost", "estimate", "late", "per_line"]
