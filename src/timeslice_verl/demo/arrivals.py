"""Rollout arrivals shaped like verl's fully-async rollouter, seeded. Pure: the caller says what time it is.

verl's rollouter keeps a fixed number of requests in flight on each replica; a response's generation time has a
long tail (its length); a finished request delivers its sample to the message queue and the next request starts at
once; production holds while the queue is at the staleness bound (``required × (1 + staleness)`` samples); a
weight sync interrupts the requests in flight (partial rollout: they resume after it, later by the sync's pause);
and responses grow longer as training goes on. :class:`RolloutSim` plays exactly that in a virtual clock: the
demo drives it with the wall clock (:class:`~timeslice_verl.demo.trainer.DemoRollout`), the forecast's tests with
a virtual one. The random draws come in the order requests start, from one seeded generator, so a solo run and a
time-sliced run of one seed see the same responses.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """One shape of rollout."""

    name: str
    replicas: int = 2
    in_flight: int = 8
    """Requests in flight per replica."""
    gen_s: float = 1.0
    """Median generation time of a response at the start of the run, seconds."""
    sigma: float = 0.6
    """Spread of the (log-normal) generation time: its long tail."""
    drift: float = 0.0
    """How much longer responses grow per training step (0.03: +3 % a step)."""
    staleness: float = 0.5
    """The queue holds at most ``required × (1 + staleness)`` samples; production holds at the bound."""
    sync_pause_s: float = 0.3
    """A weight sync delays every request in flight by this much (partial rollout)."""


PROFILES: dict[str, Profile] = {
    # many requests in flight, a moderate tail: samples come often, the staleness bound twice a batch
    "fleet": Profile("fleet", replicas=4, in_flight=16, sigma=0.5, drift=0.02, staleness=1.0, sync_pause_s=0.3),
    # fewer in flight, a heavy tail, lengths that grow faster, a tighter bound: samples come in clumps, the last late
    "longtail": Profile("longtail", replicas=2, in_flight=12, sigma=0.8, drift=0.03, staleness=0.5, sync_pause_s=0.5),
}
"""The realistic shapes the demo and ``benchmarks/valleys.py`` offer beside ``even`` (samples evenly over a batch)."""


def scaled(profile: Profile, *, required: int, valley_s: float) -> Profile:
    """``profile`` with its generation time set so a batch of ``required`` takes about ``valley_s`` at the start."""
    cap = max(required, math.ceil(required * (1 + profile.staleness)))
    slots = min(profile.replicas * profile.in_flight, cap)  # in flight at once: at most the staleness bound
    mean = math.exp(profile.sigma**2 / 2)  # a log-normal's mean over its median
    gen = valley_s * slots / required / mean
    return Profile(**{**profile.__dict__, "gen_s": gen})


class RolloutSim:
    """The rollouter and its message queue in a virtual clock (seconds from the start)."""

    def __init__(self, profile: Profile, required: int, seed: int = 0) -> None:
        self.profile, self.required = profile, required
        self.cap = max(required, math.ceil(required * (1 + profile.staleness)))
        self.rng = random.Random(seed)
        self.queued = 0
        self.step = 0
        self.now = 0.0
        self.arrivals: list[float] = []
        """When each sample reached the queue."""
        self._slots: list[tuple[float, int]] = []
        """(finish time, slot) of the requests in flight."""
        self._idle: list[int] = list(range(profile.replicas * profile.in_flight))
        self._start_idle(0.0)

    def _gen_s(self) -> float:
        p = self.profile
        return p.gen_s * (1 + p.drift * self.step) * math.exp(self.rng.gauss(0.0, p.sigma))

    def _start_idle(self, t: float) -> None:
        """Idle slots start a request, as long as the queue and what is in flight stay under the bound."""
        while self._idle and self.queued + len(self._slots) < self.cap:
            heapq.heappush(self._slots, (t + self._gen_s(), self._idle.pop()))

    def next_event(self) -> float:
        """When the next sample arrives (inf: production holds at the bound)."""
        return self._slots[0][0] if self._slots else math.inf

    def advance(self, t: float) -> int:
        """Run the clock to ``t``; the samples that arrived meanwhile."""
        arrived = 0
        while self._slots and self._slots[0][0] <= t:
            done, slot = heapq.heappop(self._slots)
            self.queued += 1
            arrived += 1
            self.arrivals.append(done)
            self._idle.append(slot)
            self._start_idle(done)
        self.now = max(self.now, t)
        return arrived

    def take(self) -> bool:
        """The trainer takes a batch when one is queued (True); production resumes under the bound."""
        if self.queued < self.required:
            return False
        self.queued -= self.required
        self.step += 1
        self._start_idle(self.now)
        return True

    def sync(self) -> None:
        """A weight sync now: every request in flight is held back by the sync's pause."""
        pause = self.profile.sync_pause_s
        self._slots = [(t + pause, slot) for t, slot in self._slots]
        heapq.heapify(self._slots)


__all__ = ["PROFILES", "Profile", "RolloutSim", "scaled"]
