"""The way back, ahead of need: a thread that brings the trainer's GPUs back before its batch is complete.

Started at each release with the valley's frozen :class:`~timeslice_verl.handoff.forecast.ValleyPlan` and a copy of
what the forecast knew of the arrivals; it reads the backlog (within its bound) every :data:`POLL_S` and, once the
plan says the way back is due, runs the handoff's ``bring_back`` (the agent's acquire, and every rank's unpark
where one process drives them all). It owns nothing of the handoff: everything it did — the backlog reads, the
moment it decided, the acquire's figures, whether the ranks have their tensors — is an :class:`Outcome` the
trainer's thread takes (:meth:`WayBack.take`) and applies itself. Taking it stops a way back not yet started
at once (without waiting for a read in flight) and waits, within the caller's bound, for one under way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from timeslice_verl.handoff.backlog import Backlog
from timeslice_verl.handoff.forecast import ArrivalRate, ValleyPlan
from timeslice_verl.log import get_logger

log = get_logger("handoff")

POLL_S = 0.1
"""How often the backlog is read while the valley lasts."""


@dataclass
class Outcome:
    """What one way back did, for the trainer's thread to take in."""

    released: float
    """When the valley began (``time.monotonic``)."""
    reads: list[tuple[float, tuple[int, int] | None]] = field(default_factory=list)
    """The backlog as read during the valley, in order."""
    fired: float | None = None
    """When it began bringing the GPUs back; None: it did not."""
    why: str = ""
    """What the read that fired it said (the prepare's detail in the timeline)."""
    done: float | None = None
    figures: Any = None
    """The background acquire's figures (the trainer reports them, with the time they carry)."""
    granted: bool = False
    """The agent gave the GPUs back."""
    unparked: bool = False
    """Every rank has its tensors again."""
    error: BaseException | None = None
    running: bool = False
    """Taken while still bringing the GPUs back (the caller's bound ran out)."""


class WayBack:
    def __init__(self, backlog: Backlog, bring_back: Callable[[], tuple[Any, bool, bool]], poll_s: float = POLL_S) -> None:
        self.backlog, self.bring_back, self.poll_s = backlog, bring_back, poll_s
        self._lock = threading.Lock()
        self._run: Outcome | None = None
        self._cancel = threading.Event()
        self._finished = threading.Event()

    def start(self, plan: ValleyPlan, arrivals: ArrivalRate, released: float) -> None:
        """Watch the valley that begins now (``arrivals``: the way back's own copy, which it alone touches)."""
        with self._lock:
            self._cancel.set()  # a previous watch ends
            run, cancel, finished = Outcome(released=released), threading.Event(), threading.Event()
            self._run, self._cancel, self._finished = run, cancel, finished
        threading.Thread(target=self._watch, args=(run, plan, arrivals, cancel, finished), daemon=True,
                         name="timeslice-wayback").start()

    def take(self, timeout_s: float | None) -> Outcome | None:
        """Stop a way back not yet under way and take what it did; wait up to ``timeout_s`` for one under way (its
        outcome is then ``running`` if it did not finish in time). None when no way back was watching."""
        with self._lock:
            run, finished = self._run, self._finished
            if run is None:
                return None
            self._cancel.set()
            if run.fired is None:  # it will never fire now: its thread, maybe inside a read, ends by itself
                self._run = None
                return Outcome(released=run.released, reads=list(run.reads))
        if not finished.wait(timeout_s):
            return Outcome(released=run.released, reads=list(run.reads), fired=run.fired, running=True)
        with self._lock:
            if self._run is run:
                self._run = None
        return run

    def _watch(self, run: Outcome, plan: ValleyPlan, arrivals: ArrivalRate, cancel: threading.Event,
               finished: threading.Event) -> None:
        try:
            while not cancel.is_set():
                backlog = self.backlog.read()
                now = time.monotonic()
                if backlog is not None:
                    arrivals.observe(now, *backlog)
                missing = None if backlog is None else max(0, backlog[1] - backlog[0])
                rate = plan.pace(arrivals)
                age = now - (arrivals.last_arrival or run.released)
                due = plan.due_in(missing, rate, age_s=age, elapsed_s=now - run.released)
                with self._lock:
                    if cancel.is_set():
                        return
                    run.reads.append((now, backlog))
                    if due is None and backlog is None:
                        return  # nothing to go on: the trainer's acquire does the way back
                    if due is not None and due <= 0:
                        run.fired, run.why = now, _why(backlog, rate, age, now - run.released)
                if run.fired is None:  # no rate yet: the batch's completion still says "now"
                    cancel.wait(self.poll_s if due is None else min(due, self.poll_s))
                    continue
                self._bring(run)
                return
        finally:
            finished.set()

    def _bring(self, run: Outcome) -> None:
        try:
            run.figures, run.granted, run.unparked = self.bring_back()
            if run.figures is not None and not run.figures.detail:
                run.figures.detail = run.why
        except BaseException as exc:  # the trainer's acquire sees it and tries again
            run.error = exc
            log.warning("[timeslice] the way back ahead of need failed (the acquire tries again): %s", exc)
        finally:
            run.done = time.monotonic()


def _why(backlog: tuple[int, int] | None, rate: float | None, age_s: float, elapsed_s: float) -> str:
    if backlog is None:
        return f"no backlog: the valleys' own lengths say due, {elapsed_s:.2f} s after the release"
    queued, required = backlog
    pace = f" at {rate:.2f}/s" if rate else ""
    return (f"{queued}/{required} samples{pace}, {age_s:.2f} s after the last one and {elapsed_s:.2f} s after the "
            "release: due")


__all__ = ["POLL_S", "Outcome", "WayBack"]
