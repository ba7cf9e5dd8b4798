"""The demo's trainer parts that stand for verl's: the rollout's message queue and the worker group.

* :class:`DemoRollout`: fully-async's rollouter and message queue. Batches arrive one after another on
  their own schedule, whatever the trainer does (verl's rollout runs on other GPUs); the trainer takes
  ``required`` samples per step and waits for them — its idle valley. ``backlog()`` is what the adapters
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

from timeslice_verl.park import ParkError

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
    """Samples arrive evenly over each batch's time (see :func:`schedule`), into a queue the trainer drains."""

    def __init__(self, batch_s: list[float], required: int = 16) -> None:
        self.batch_s = batch_s
        self.required = required
        self.queued = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, daemon=True, name="demo-rollout")

    def start(self) -> DemoRollout:
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
            self.queued -= self.required
        return time.monotonic() - t0

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.ident is not None:  # stopped before it started: nothing to wait for
            self._thread.join(5)


class DemoRanks:
    """The handoff's ranks (:class:`~timeslice_verl.handoff.Ranks`) over the demo worker process."""

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
