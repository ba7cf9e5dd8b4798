"""A trainer, its rollout and the handoff's forecast in a virtual clock: how early or late the way back would be.

:func:`replay` plays a fully-async run — the rollout of :mod:`timeslice_verl.demo.arrivals` (or samples evenly over
each batch), a step of ``train_s`` on the GPU, a weight sync, a release — and applies the real
:class:`~timeslice_verl.handoff.forecast.ValleyForecast` and :class:`~timeslice_verl.handoff.forecast.ValleyPlan` as
the handoff and its way back do: the backlog read at each acquire and release and every ``poll_s`` in a valley,
the way back started when the plan says so and taking ``way_back_s``. Nothing sleeps: a run of hundreds of valleys
takes milliseconds, the same for every seed, so tests can hold the forecast's errors to bounds and
``benchmarks/forecast.py`` can print them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from timeslice_verl.demo.arrivals import PROFILES, RolloutSim, scaled
from timeslice_verl.handoff.forecast import ValleyForecast


@dataclass
class Replay:
    """What the way back did over a run (seconds)."""

    lent: int = 0
    skipped: int = 0
    early: list[float] = field(default_factory=list)
    """The GPUs were back this long before the batch was (lost tenant time)."""
    late: list[float] = field(default_factory=list)
    """The trainer waited this long for its GPUs."""
    below_break_even: int = 0
    """Lent valleys shorter than the round trip."""
    valleys: list[float] = field(default_factory=list)
    """Every valley's length, lent or not."""

    def quantile(self, values: list[float], q: float) -> float:
        data = sorted(values)
        if not data:
            return 0.0
        pos = (len(data) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)


class _Even:
    """Samples evenly over each batch's time: the demo's first schedule, 12 s ± 20 % by default."""

    def __init__(self, required: int, valley_s: float, seed: int) -> None:
        self.required, self.valley_s, self.rng = required, valley_s, random.Random(seed)
        self.queued, self.now, self._next, self._gap = 0, 0.0, 0.0, 0.0
        self._new_batch()

    def _new_batch(self) -> None:
        self._gap = self.valley_s * self.rng.uniform(0.8, 1.2) / self.required
        self._left, self._next = self.required, self.now + self._gap

    def next_event(self) -> float:
        return self._next

    def advance(self, t: float) -> int:
        n = 0
        while self._next <= t:
            self.queued, n, self._left = self.queued + 1, n + 1, self._left - 1
            self.now = self._next
            if self._left == 0:
                self._new_batch()
            else:
                self._next += self._gap
        self.now = max(self.now, t)
        return n

    def take(self) -> bool:
        if self.queued < self.required:
            return False
        self.queued -= self.required
        return True

    def sync(self) -> None:
        pass


def _until(sim, t: float, required: int) -> float:
    """Advance to ``t`` or to the batch's completion, whichever comes first; the time reached."""
    while sim.queued < required and sim.next_event() <= t:
        sim.advance(sim.next_event())
    if sim.queued < required:
        sim.advance(t)
        return t
    return sim.now


def replay(profile: str = "fleet", *, steps: int = 40, required: int = 32, train_s: float = 3.0, valley_s: float = 8.0,
           way_back_s: float = 0.15, round_trip_s: float | None = None, late_cost: float = 4.0, margin: float = 1.5,
           poll_s: float = 0.1, seed: int = 0) -> Replay:
    """A virtual run of ``steps`` valleys; ``profile``: ``even`` or a name of :data:`~timeslice_verl.demo.arrivals.PROFILES`."""
    sim = _Even(required, valley_s, seed) if profile == "even" else \
        RolloutSim(scaled(PROFILES[profile], required=required, valley_s=valley_s), required, seed)
    f = ValleyForecast(margin=margin, late_cost=late_cost)
    trip = round_trip_s if round_trip_s is not None else 2 * way_back_s
    f.round_trip_estimate = trip
    out, t = Replay(), 0.0
    for _ in range(steps):
        t = _until(sim, math.inf, required)  # the first batch
        sim.take()
        f.observe_backlog(t, (sim.queued, required))  # the acquire's read, once the batch is taken
        t += train_s  # the step: the rollout goes on meanwhile
        sim.advance(t)
        sim.sync()
        backlog = (sim.queued, required)
        f.observe_backlog(t, backlog)
        decision = f.decide(backlog)
        released = t
        if not decision.release:
            out.skipped += 1
            end = _until(sim, math.inf, required)
            out.valleys.append(end - released)
            f.observe_valley(end - released)
            continue
        end, fired, reads = _valley(sim, f, released, required, way_back_s, poll_s)
        _score(out, f, end, fired, reads, released, way_back_s, trip)
        t = end
        sim.advance(t)
    return out


def _valley(sim, f: ValleyForecast, released: float, required: int, way_back_s: float,
            poll_s: float) -> tuple[float, float | None, list[tuple[float, float]]]:
    """The way back through one lent valley: (the batch's completion, when the way back started, its looks)."""
    plan, arrivals, tp = f.plan(), f.arrivals.copy(), released
    reads: list = [(released, (sim.queued, required))]
    while True:
        reached = _until(sim, tp, required)
        if sim.queued >= required:  # the batch came before the way back started: the trainer's acquire does it
            return reached, None, reads
        arrivals.observe(tp, sim.queued, required)
        f.observe_backlog(tp, (sim.queued, required))
        reads.append((tp, (sim.queued, required)))
        missing, rate = required - sim.queued, plan.pace(arrivals)
        age = tp - (arrivals.last_arrival or released)
        due = plan.due_in(missing, rate, age_s=age, elapsed_s=tp - released)
        if due is not None and due <= 0:
            return _until(sim, math.inf, required), tp, reads
        tp += poll_s if due is None else max(1e-3, min(due, poll_s))


def _score(out: Replay, f: ValleyForecast, end: float, fired: float | None, reads: list, released: float,
           way_back_s: float, trip: float) -> None:
    out.lent += 1
    out.valleys.append(end - released)
    if end - released < trip:
        out.below_break_even += 1
    back = (fired if fired is not None else end) + way_back_s
    (out.late if back > end else out.early).append(abs(back - end))
    f.observe_backlog(end, (required_of(reads), required_of(reads)))  # the trainer's read when it asks
    f.observe_valley(end - released, reads, end=end)
    f.observe_way_back(way_back_s)
    f.observe_round_trip(trip)


def required_of(reads: list) -> int:
    return reads[0][1][1]


__all__ = ["Replay", "replay"]
