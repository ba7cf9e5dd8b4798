"""The trainer's idle valleys as the handoff sees them: whether one is worth lending, and when to come back. Pure.

:class:`~timeslice_verl.handoff.sequence.Handoff` feeds it what it reads and measures (no I/O, no clock here):

* **Arrivals.** The *backlog* (samples queued for the next step against the samples it needs: fully-async's
  message queue, v1's replay buffer) is read at each acquire and release and, during a valley, by the way back.
  What it grew by between two reads are arrivals: :class:`ArrivalRate` keeps the rate over the last ``window``
  samples, so it follows this valley's production (and the growth of response lengths over a run) rather than a
  median of old valleys. Reads taken while a whole batch was queued do not count (production may be held at the
  staleness bound then).
* **The remaining wait, as this run showed it.** When a valley ends, the way back's reads say when each count of
  missing samples was reached and so how long the batch still took from there: for each count ``k``, recent
  valleys' remaining waits, in units of the mean time between samples (so lengths that grow over a run scale
  them). With ``k`` missing ``a`` seconds after the last sample came, the remaining wait is one of those that
  outlasted ``a``, less ``a``: even arrivals give one exact answer, a long tail a spread, Poisson arrivals forget
  the age — whatever the rollout's shape, from its own record. Until a count has :data:`MIN_TAIL` of them, the
  same quantile of the time to ``k`` Poisson arrivals at rate ``λ`` (an Erlang's), less the next one's progress
  ``min(λa, 0.95) / λ`` but never below the quantile for ``k - 1`` (a long wait says the next sample may be near,
  not the rest), stands in (the expectation did before: a way back late in half the valleys of a short run).
  The way back trusts its own valley's rate after :data:`MIN_ARRIVALS` samples, the release's until then.
* **When to come back.** Starting the way back (``w`` seconds: the tenant's yield, the thaw, the unpark) at ``f``
  costs ``late_cost`` per second the trainer then waits and 1 per second the GPU sits back with the trainer
  unused; the expected cost is lowest when the batch is ready before ``f + w`` with probability
  ``1 / (1 + late_cost)`` (the newsvendor's quantile). So the way back starts once that quantile of the remaining
  wait is down to ``w``: the lead is the swap's way back and this run's spread.
* **Break-even.** A valley is lent only when its expected length is ``margin`` round trips and its 10 % quantile
  (samples taken as Poisson arrivals) at least one. Round trips are measured in the run; before the first, the
  handoff's estimate (bytes to move over this node's bandwidth, plus the tenant's yield). A full backlog is no
  valley. With nothing to forecast yet (no rate), only a handoff cheaper than :data:`COLD_TRIP_S` is lent.
* Without a backlog signal (an SPMD trainer that gives none) the valleys' own lengths stand in for the forecast:
  the way back starts ``w`` before their low quantile.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

MARGIN = 1.5
"""How many round trips a valley must be expected to last to be lent (``timeslice.handoff.break_even_margin``)."""
LATE_COST = 4.0
"""A second of trainer wait against a second of GPU time lost to the tenant (``timeslice.handoff.late_cost``)."""
COLD_TRIP_S = 1.0
"""With nothing to forecast a valley by, it is lent only when the handoff's round trip is estimated below this."""
MIN_TAIL = 5
"""Remaining waits a count of missing samples needs before they, not the rate's Erlang quantile, time the way back."""
MIN_ARRIVALS = 6
"""Arrivals a valley's own rate needs before it is trusted over the plan's (two samples a moment apart after a
weight sync's pause read as a rate ten times too low: the way back then never fired in a run's second valley)."""
PROGRESS_CAP = 0.95


# ------------------------------------------------------------------ helpers


ERLANG_EXACT_K = 200
"""Up to this many arrivals the CDF is summed term by term (in log space); past it, Wilson–Hilferty."""


def erlang_cdf(x: float, k: int, rate: float) -> float:
    """P(the ``k``-th arrival of a Poisson process of ``rate`` comes within ``x``). Bounded work for any input:
    the Poisson terms are taken in log space (``exp(-rate·x)`` alone underflows past 745), and past
    :data:`ERLANG_EXACT_K` arrivals the gamma's cube root is taken as normal (Wilson–Hilferty; off by < 1e-3 there,
    less beyond)."""
    if k <= 0 or x == math.inf:
        return 1.0
    if not x > 0 or not rate > 0:
        return 0.0
    lx = rate * x
    if not math.isfinite(lx):
        return 1.0
    if k > ERLANG_EXACT_K:
        spread = 1.0 / (9.0 * k)
        z = ((lx / k) ** (1.0 / 3.0) - (1.0 - spread)) / math.sqrt(spread)
        return max(0.0, min(1.0, 0.5 * math.erfc(-z / math.sqrt(2.0))))
    log_lx = math.log(lx)
    below = math.fsum(math.exp(-lx + i * log_lx - math.lgamma(i + 1)) for i in range(int(k)))
    return max(0.0, min(1.0, 1.0 - below))


def erlang_quantile(p: float, k: int, rate: float) -> float:
    """The ``p`` quantile of the time to the ``k``-th arrival (bisection on :func:`erlang_cdf`)."""
    if k <= 0:
        return 0.0
    lo, hi = 0.0, (k + 10 * math.sqrt(k) + 10) / rate
    for _ in range(60):
        mid = (lo + hi) / 2
        if erlang_cdf(mid, k, rate) < p:
            lo = mid
        else:
            hi = mid
    return hi


def quantile(values: list[float] | tuple[float, ...], q: float) -> float:
    data = sorted(values)
    pos = (len(data) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def remaining(missing: int, rate: float, age_s: float) -> float:
    """Expected seconds until ``missing`` samples came at ``rate``, the next one ``age_s`` along."""
    return max(0.0, missing - min(rate * max(0.0, age_s), PROGRESS_CAP)) / rate


# ------------------------------------------------------------------ arrivals


class ArrivalRate:
    """Samples per second over the last ``window`` arrivals, from successive backlog reads."""

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self.spans: deque[tuple[float, int]] = deque()
        """(seconds, arrivals) between successive reads that count."""
        self.last_arrival: float | None = None
        """When a read last showed a new sample."""
        self._last: tuple[float, int, int] | None = None

    def observe(self, t: float, queued: int, required: int) -> int:
        """A backlog read at ``t``; the arrivals it shows since the last read."""
        last, self._last = self._last, (t, queued, required)
        if last is None or t <= last[0]:
            return 0
        t0, q0, _ = last
        arrivals = max(0, queued - q0 if queued >= q0 else queued + required - q0)  # fewer: a batch was taken between
        if arrivals:
            self.last_arrival = t
        if required > 0 and q0 >= required:  # a whole batch waited: production may be held at the bound
            return arrivals
        self.spans.append((t - t0, arrivals))
        while len(self.spans) > 1 and sum(n for _, n in self.spans) - self.spans[0][1] >= self.window:
            self.spans.popleft()
        return arrivals

    def copy(self) -> ArrivalRate:
        """A copy for another thread to go on with (the way back's)."""
        out = ArrivalRate(self.window)
        out.spans, out._last, out.last_arrival = deque(self.spans), self._last, self.last_arrival
        return out

    def forget_last(self) -> None:
        """The next read starts a new span (a read that could not be trusted)."""
        self._last = None

    @property
    def count(self) -> int:
        return sum(n for _, n in self.spans)

    def rate(self) -> float | None:
        """Arrivals per second, or None before two arrivals were seen."""
        seconds = sum(s for s, _ in self.spans)
        return self.count / seconds if self.count >= 2 and seconds > 0 else None


# ------------------------------------------------------------------ one valley's plan (what the way back follows)


@dataclass(frozen=True)
class ValleyPlan:
    """What the way back needs to time one valley, frozen at its release (the way back's thread only reads it)."""

    rate: float | None
    """Arrivals per second at the release; None without a backlog rate."""
    way_back_s: float
    """How long the way back takes (the last one measured, else the handoff's estimate)."""
    level: float = 0.2
    """The probability of a late way back that the costs call for."""
    tails: tuple[tuple[float, ...], ...] = ()
    """For each count of missing samples, recent remaining waits in mean gaps between samples."""
    lead_s: float = 0.0
    """A fixed lead instead (``timeslice.handoff.prepare_lead_s``): start when the expected wait is down to it."""
    valleys: tuple[float, ...] = ()
    """Recent valley lengths (for trainers without a backlog signal)."""

    def pace(self, arrivals: ArrivalRate) -> float | None:
        """The rate the way back times the valley by: its own arrivals' once there are :data:`MIN_ARRIVALS`, else the
        release's."""
        own = arrivals.rate() if arrivals.count >= MIN_ARRIVALS else None
        return own or self.rate

    def erlang_wait(self, missing: int, rate: float, age_s: float) -> float:
        """The level's quantile of the wait for ``missing`` Poisson arrivals, less the next one's progress after
        ``age_s`` — never below the quantile for the ones after it: a long wait since the last sample says the next
        may be near, not the rest (two missing after a long train step read "now" and the GPUs came back a whole
        valley early)."""
        progress = min(rate * max(0.0, age_s), PROGRESS_CAP) / rate
        return max(erlang_quantile(self.level, missing, rate) - progress, erlang_quantile(self.level, missing - 1, rate))

    def expected(self, missing: int | None, rate: float | None, age_s: float) -> float | None:
        rate = rate or self.rate
        if missing is None or not rate:
            return None
        return 0.0 if missing <= 0 else remaining(missing, rate, age_s)

    def due_in(self, missing: int | None, rate: float | None = None, *, age_s: float = 0.0,
               elapsed_s: float = 0.0) -> float | None:
        """Seconds until the way back should start (0: now), with ``missing`` samples still to come at ``rate``
        (default: the release's), the next ``age_s`` along, ``elapsed_s`` after the release; None when nothing tells."""
        if missing is not None and missing <= 0:
            return 0.0  # the batch is complete: now
        rate = rate or self.rate
        if missing is not None and rate:
            tail = self.tails[missing] if missing < len(self.tails) else ()
            if self.lead_s > 0:
                return max(0.0, remaining(missing, rate, age_s) - self.lead_s)
            if len(tail) < MIN_TAIL:  # the level's quantile of the time to ``missing`` arrivals at this rate
                return max(0.0, self.erlang_wait(missing, rate, age_s) - self.way_back_s)
            ahead = [u / rate - age_s for u in tail if u / rate > age_s]
            if not ahead:  # longer than any valley of this run at this count: now
                return 0.0
            return max(0.0, quantile(ahead, self.level) - self.way_back_s)
        if self.valleys:  # no backlog: the valleys' own lengths
            return max(0.0, quantile(self.valleys, self.level) - (self.lead_s or self.way_back_s) - elapsed_s)
        return None


@dataclass(frozen=True)
class Decision:
    release: bool
    reason: str
    expected_s: float | None = None
    """The valley's expected length (None when there is nothing to go on)."""


# ------------------------------------------------------------------ what the handoff learns over a run


class ValleyForecast:
    """What the handoff learned of this run's valleys, and the rules it applies (see the module)."""

    def __init__(self, *, lead_s: float = 0.0, margin: float = MARGIN, late_cost: float = LATE_COST,
                 history: int = 20, window: int = 32) -> None:
        self.lead_s, self.margin, self.late_cost = lead_s, margin, late_cost
        self.arrivals = ArrivalRate(window)
        self.round_trips: deque[float] = deque(maxlen=5)
        self.round_trip_estimate: float | None = None
        """Before any round trip was measured: bytes to move over this node's bandwidth, plus the tenant's yield."""
        self.way_back_s: float | None = None
        """The way back planned for: the upper quartile of the recent ones (a tenant's pause under load varies ten-fold
        from one valley to the next; the latest alone made the trainer wait whenever it was short)."""
        self.way_backs: deque[float] = deque(maxlen=12)
        self.history = history
        self.tails: dict[int, deque[float]] = {}
        """Samples missing → recent remaining waits from the moment that many were missing, in mean gaps."""
        self.valleys: deque[float] = deque(maxlen=history)

    # ------------------------------------------------------------------ what was measured

    def observe_backlog(self, t: float, backlog: tuple[int, int] | None) -> None:
        if backlog is None:
            self.arrivals.forget_last()
        else:
            self.arrivals.observe(t, *backlog)

    def observe_way_back(self, seconds: float) -> None:
        """How long the last way back took: the tenant's yield, the thaw and the ranks' unpark."""
        if seconds > 0:
            self.way_backs.append(seconds)
            ranked = sorted(self.way_backs)
            self.way_back_s = ranked[(3 * len(ranked)) // 4]

    def observe_round_trip(self, seconds: float) -> None:
        """What one whole handoff cost (out and back)."""
        if seconds > 0:
            self.round_trips.append(seconds)

    def observe_valley(self, seconds: float, reads: list[tuple[float, tuple[int, int] | None]] = (),  # type: ignore[assignment]
                       end: float = 0.0) -> None:
        """A valley ended after ``seconds`` (at ``end``); ``reads``: the backlog as read through it, which says when
        each count of missing samples was reached, and so what remained of the wait from there."""
        if seconds >= 0:
            self.valleys.append(seconds)
        rate = self.arrivals.rate()
        if not rate:
            return
        reached: dict[int, float] = {}
        lowest: int | None = None
        for t, backlog in reads:
            if backlog is None:
                continue
            missing = max(0, backlog[1] - backlog[0])
            if lowest is not None and missing < lowest:  # counts passed since the last read: reached by this one
                reached.update({k: t for k in range(missing, lowest)})
            lowest = missing if lowest is None else min(lowest, missing)
        for k, t in reached.items():
            if k > 0 and end >= t:
                self.tails.setdefault(k, deque(maxlen=self.history)).append((end - t) * rate)

    # ------------------------------------------------------------------ the rules

    def round_trip(self) -> float | None:
        return statistics.median(self.round_trips) if self.round_trips else self.round_trip_estimate

    def level(self) -> float:
        """The probability of a late way back that minimises the cost (the newsvendor's)."""
        return 1.0 / (1.0 + self.late_cost)

    def decide(self, backlog: tuple[int, int] | None) -> Decision:
        """Lend the GPU for the valley that starts now? ``backlog``: (queued, required), or None if unknown."""
        trip = self.round_trip()
        if self.margin <= 0:
            return Decision(True, "every valley is lent (break_even_margin=0)")
        if backlog is None:
            return self._decide_blind(trip)
        queued, required = backlog
        if required > 0 and queued >= required:
            return Decision(False, f"next batch queued ({queued}/{required} samples)", 0.0)
        rate = self.arrivals.rate()
        if rate is None:
            return self._cold(trip)
        missing = max(1, required - queued)
        expected = missing / rate
        if trip is None:
            return Decision(True, f"valley {expected:.2f} s expected; no round trip known yet", expected)
        low = erlang_quantile(0.1, missing, rate)
        if expected < self.margin * trip or low < trip:
            return Decision(False, f"valley {expected:.2f} s expected (10 %: {low:.2f} s; {queued}/{required} samples at "
                                   f"{rate:.2f}/s) < {self.margin:g} × round trip {trip:.2f} s", expected)
        return Decision(True, f"valley {expected:.2f} s expected (10 %: {low:.2f} s) ≥ {self.margin:g} × round trip "
                              f"{trip:.2f} s", expected)

    def _cold(self, trip: float | None) -> Decision:
        if trip is not None and trip <= COLD_TRIP_S:
            return Decision(True, f"no valley forecast yet; the round trip ({trip:.2f} s) is cheap enough to lend")
        why = "unknown" if trip is None else f"{trip:.2f} s"
        return Decision(False, f"no valley forecast yet and the round trip ({why}) is not below {COLD_TRIP_S:g} s: "
                               "learning this valley")

    def _decide_blind(self, trip: float | None) -> Decision:
        if not self.valleys:
            return self._cold(trip) if trip is not None else Decision(True, "no backlog signal")
        expected = statistics.median(self.valleys)
        if trip is not None and expected < self.margin * trip:
            return Decision(False, f"recent valleys {expected:.2f} s < {self.margin:g} × round trip {trip:.2f} s", expected)
        return Decision(True, f"recent valleys {expected:.2f} s (no backlog signal)", expected)

    def plan(self) -> ValleyPlan:
        """The frozen plan the way back follows through the valley that starts now."""
        way_back = self.way_back_s
        if way_back is None:
            trip = self.round_trip()
            way_back = trip / 2 if trip is not None else 0.0
        depth = max(self.tails, default=0) + 1
        tails = tuple(tuple(self.tails.get(k, ())) for k in range(depth))
        return ValleyPlan(rate=self.arrivals.rate(), way_back_s=way_back, level=self.level(), tails=tails,
                          lead_s=self.lead_s, valleys=tuple(self.valleys))


__all__ = ["COLD_TRIP_S", "LATE_COST", "MIN_ARRIVALS", "MIN_TAIL", "MARGIN", "ArrivalRate", "Decision", "ValleyForecast", "ValleyPlan",
           "erlang_cdf", "erlang_quantile", "quantile", "remaining"]
