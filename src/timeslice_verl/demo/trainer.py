"""The demo's trainer parts that stand for verl's: the rollout's message queue and the worker group.

* :class:`DemoRollout`: fully-async's rollouter and message queue. Samples arrive on their own schedule (evenly,
  or shaped like verl's rollouter), whatever the trainer does (verl's rollout runs on other GPUs); the trainer
  takes ``required`` samples per step and waits for them — its idle valley. ``backlog()`` is what the adapters
  read off verl's queue, so the handoff can skip a release when the next batch is already there.
* :class:`DemoRanks`: the demo worker process as the handoff's ranks (one process, driven from here like
  verl's worker group): park, unpark and cache release run in the worker, over its pipe.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

from timeslice_verl.demo.arrivals import PROFILES, RolloutSim, scaled
from timeslice_verl.ranks.park import ParkError

BURST_SPEEDUP = 20.0
"""A burst batch comes this much faster than the others (its valley is too short to lend)."""


def schedule(steps: int, rollout_s: float, *, burst_every: int = 0, seed: int = 0) -> list[float]:
    """Seconds the rollout takes for each batch: ``rollout_s`` ± 20 %, every ``burst_every``-th batch
    :data:`BURST_SPEEDUP` times faster (0: none). The seed fixes it, so solo and time-sliced runs see the same."""
    rng = random.Random(seed)
    out = []
    for i in range(steps):
        s = rollout_s * rng.uniform(0.8, 1.2)
        out.append(s / BURST_SPEEDUP if burst_every and (i + 1) % burst_every == 0 else s)
    return out


class DemoRollout:
    """fully-async's message queue, filled by a producer thread the trainer drains ``required`` samples at a time.

    ``even``: samples arrive evenly over each batch's time (see :func:`schedule`). ``profiled``: the rollouter of
    :mod:`~timeslice_verl.demo.arrivals` (requests in flight per replica, long-tailed lengths, the staleness bound,
    drift, the weight sync's interruption) played in the wall clock."""

    def __init__(self, batch_s: list[float], required: int = 16, *, sim: RolloutSim | None = None) -> None:
        self.batch_s, self.sim = batch_s, sim
        self.required = sim.required if sim is not None else required
        self.queued = 0
        self._t0 = 0.0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce if sim is None else self._simulate, daemon=True,
                                        name="demo-rollout")

    @classmethod
    def profiled(cls, name: str, *, required: int, batch_s: float, seed: int = 0) -> DemoRollout:
        if name not in PROFILES:
            raise ValueError(f"rollout profile {name!r} is not one of: even, {', '.join(PROFILES)}")
        return cls([], sim=RolloutSim(scaled(PROFILES[name], required=required, valley_s=batch_s), required, seed=seed))

    def start(self) -> DemoRollout:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _produce(self) -> None:
        for seconds in self.batch_s:
            for _ in range(self.required):
                if self._stop.wait(seconds / self.required):
                    return
                with self._cond:
                    self.queued += 1
                    self._cond.notify_all()

    def _simulate(self) -> None:
        assert self.sim is not None
        with self._cond:
            while not self._stop.is_set():
                now = time.monotonic() - self._t0
                if self.sim.next_event() <= now:
                    self.sim.advance(now)
                    self.queued = self.sim.queued
                    self._cond.notify_all()
                    continue
                self._cond.wait(min(self.sim.next_event() - now, 1.0))  # woken early by a take or a sync

    def backlog(self) -> tuple[int, int]:
        """(queued, required) samples for the next step, as the adapters read verl's message queue."""
        with self._cond:
            return self.queued, self.required

    def take(self) -> float:
        """Block until a batch is queued, take it; the seconds waited (the trainer's valley)."""
        t0 = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(lambda: self.queued >= self.required or self._stop.is_set(), timeout=3600):
                raise TimeoutError("the demo rollout produced no batch within an hour")
            if self._stop.is_set():
                raise RuntimeError("the demo rollout was stopped")
            if self.sim is None:
                self.queued -= self.required
            else:
                self.sim.advance(time.monotonic() - self._t0)
                self.sim.take()  # production resumes under the staleness bound, from now
                self.queued = self.sim.queued
                self._cond.notify_all()
        return time.monotonic() - t0

    def sync(self) -> None:
        """A weight sync: the requests in flight are held back by its pause (partial rollout)."""
        if self.sim is not None and self._t0:  # before the rollouter starts there is nothing in flight
            with self._cond:
                self.sim.advance(time.monotonic() - self._t0)
                self.queued = self.sim.queued
                self.sim.sync()
                self._cond.notify_all()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.ident is not None:  # stopped before it started: nothing to wait for
            self._thread.join(5)


class DemoRanks:
    """The handoff's ranks (:class:`~timeslice_verl.handoff.sequence.Ranks`) over the demo worker process."""

    collective = False
    """One process (the trainer's driver) drives every rank: nothing to agree on."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def can_park(self) -> bool:
        return self.worker.device == "cuda"  # the dry run's worker holds host memory only

    def _ask(self, command: str, fail: bool = True) -> list[dict[str, Any]]:
        answer = self.worker.ask(command)
        try:
            report = json.loads(answer)
        except ValueError as exc:
            raise ParkError(f"demo worker answered {command!r} with {answer!r}") from exc
        if fail and "error" in report:
            raise ParkError(f"demo worker could not {command}: {report['error']}")
        return [report]

    def park_reserve(self) -> list[dict[str, Any]]:
        return self._ask("reserve")

    def park(self) -> list[dict[str, Any]]:
        return self._ask("park")

    def unpark(self) -> list[dict[str, Any]]:
        return self._ask("unpark")

    def release_caches(self) -> list[dict[str, Any]]:
        return self._ask("caches")

    def local_pids(self) -> list[int]:
        return [self.worker.proc.pid]


__all__ = ["DemoRanks", "DemoRollout", "schedule"]
