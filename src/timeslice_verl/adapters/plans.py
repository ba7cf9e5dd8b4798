"""The sequences every adapter fires around verl's methods, written once as *plans*.

A plan is a generator that yields what to do — fire a hook (:class:`Fire`), call verl's method
(:data:`CALL`), report an error (:class:`Report`), stop time-slicing (:class:`Stop`) — and gets each
outcome back (an error is thrown into it). :func:`run` and :func:`arun` drive the same plan from a
synchronous or an asynchronous method, so sync and async seams of any adapter behave identically.

The shared plans: :func:`init_plan` (model loading), :func:`sync_plan` (a weight sync),
:func:`save_plan` (a model save plugins may veto) and :func:`fit_plan` (the run: an error is reported
once, then ``timeslice_stop``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator

from timeslice_verl.events import CheckpointEvent, Event, InitWorkersEvent, WeightSyncEvent
from timeslice_verl.lifecycle import Lifecycle
from timeslice_verl.log import get_logger

log = get_logger("adapter")


@dataclass(frozen=True)
class Fire:
    hook: str
    event: Event


@dataclass(frozen=True)
class Report:
    point: str
    error: BaseException


@dataclass(frozen=True)
class Stop:
    reason: str


CALL = object()
"""The step that calls verl's own method; its return value is sent back into the plan."""
Plan = Generator[Any, Any, Any]


def _advance(plan: Plan, value: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Feed the last outcome into the plan: ``(done, next step or return value)``."""
    try:
        return False, (plan.throw(error) if error is not None else plan.send(value))
    except StopIteration as stop:
        return True, stop.value


def _action(lc: Lifecycle, step: Any, call: Callable[[], Any], *, sync: bool) -> Callable[[], Any]:
    """What a plan step asks for, as a call: blocking for ``run``, a coroutine for ``arun``."""
    if step is CALL:
        return call
    if isinstance(step, Fire):
        return lambda: (lc.call if sync else lc.fire)(step.hook, step.event)
    if isinstance(step, Report):
        return lambda: (lc.report_exception if sync else lc.areport_exception)(step.point, step.error)
    if isinstance(step, Stop):
        return lambda: (lc.stop if sync else lc.astop)(step.reason)
    raise TypeError(f"unknown plan step {step!r}")  # pragma: no cover


def run(lc: Lifecycle, plan: Plan, call: Callable[[], Any]) -> Any:
    """Drive ``plan`` from a synchronous method; ``call`` runs verl's original."""
    value, error = None, None
    while True:
        done, step = _advance(plan, value, error)
        if done:
            return step
        value, error = None, None
        try:
            value = _action(lc, step, call, sync=True)()
        except BaseException as exc:  # handed to the plan, which re-raises it
            error = exc


async def arun(lc: Lifecycle, plan: Plan, call: Callable[[], Awaitable[Any]]) -> Any:
    """Drive ``plan`` from a coroutine method (hooks run off the event loop)."""
    value, error = None, None
    while True:
        done, step = _advance(plan, value, error)
        if done:
            return step
        value, error = None, None
        try:
            value = await _action(lc, step, call, sync=False)()
        except BaseException as exc:
            error = exc


# --------------------------------------------------------------------------- the shared plans


def init_plan(lc: Lifecycle) -> Plan:
    """Model loading: begin, verl's call (an error is reported), end with how long it took."""
    t0 = time.monotonic()
    try:
        yield Fire("init_workers_begin", lc.event(InitWorkersEvent))
        result = yield CALL
    except BaseException as exc:
        yield Report("init_workers", exc)
        raise
    yield Fire("init_workers_end", lc.event(InitWorkersEvent, elapsed_s=round(time.monotonic() - t0, 6)))
    return result


def sync_plan(lc: Lifecycle, *, initial: bool, synced: Callable[[Any], bool] = lambda result: True,
              save_follows: Callable[[], bool] = lambda: False) -> Plan:
    """A weight sync: begin, verl's call (an error is reported), end with ``synced`` read off its result."""
    t0 = time.monotonic()
    try:
        yield Fire("weight_sync_begin", lc.event(WeightSyncEvent, initial=initial))
        result = yield CALL
    except BaseException as exc:
        yield Report("update_weights", exc)
        raise
    done = bool(synced(result))
    yield Fire("weight_sync_end", lc.event(WeightSyncEvent, initial=initial, synced=done,
                                           elapsed_s=round(time.monotonic() - t0, 6),
                                           save_follows=done and not initial and save_follows()))
    return result


def save_plan(lc: Lifecycle, *, force: bool, where: str) -> Plan:
    """A model save: plugins may veto it (``False``); the end says whether it saved."""
    results = yield Fire("save_checkpoint_begin", lc.event(CheckpointEvent, force=force))
    if False in results:
        log.warning("checkpoint save at %s vetoed by a plugin", where)
        yield Fire("save_checkpoint_end", lc.event(CheckpointEvent, force=force, saved=False, elapsed_s=0.0))
        return None
    t0 = time.monotonic()
    try:
        result = yield CALL
    except BaseException:
        yield Fire("save_checkpoint_end", lc.event(CheckpointEvent, force=force, saved=False,
                                                   elapsed_s=round(time.monotonic() - t0, 6)))
        raise
    yield Fire("save_checkpoint_end", lc.event(CheckpointEvent, force=force, saved=True,
                                               elapsed_s=round(time.monotonic() - t0, 6)))
    return result


def fit_plan(lc: Lifecycle, on_exit: Callable[[], None] = lambda: None) -> Plan:
    """The run: an error escaping it is reported once, then time-slicing stops (``error`` or ``finished``)."""
    try:
        result = yield CALL
    except BaseException as exc:
        on_exit()
        yield Report("fit", exc)
        yield Stop("error")
        raise
    on_exit()
    yield Stop("finished")
    return result


__all__ = ["CALL", "Fire", "Plan", "Report", "Stop", "arun", "fit_plan", "init_plan", "run", "save_plan", "sync_plan"]
