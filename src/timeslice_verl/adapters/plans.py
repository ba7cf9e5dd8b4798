"""The sequences every adapter fires around verl's methods, written once as *plans*.

A plan is a generator that yields what to do — fire a hook (:class:`Fire`, naming the hook by the dispatcher's
typed method), call verl's method (:data:`CALL`), report an error (:class:`Report`), stop time-slicing
(:class:`Stop`) — and gets each outcome back (an error is thrown into it). One plan is driven three ways:

* :func:`run` and :func:`arun`, from a synchronous or an asynchronous method that wraps verl's own call;
* :func:`begin` / :func:`abegin`, then :meth:`Paused.end` / :meth:`Paused.aend`, where verl calls the adapter
  before and after its own work (the template hooks of the fork: ``on_init_workers_begin`` … ``_end``), so the
  plan stops at its :data:`CALL` and goes on when verl is done.

The shared plans: :func:`init_plan` (model loading), :func:`sample_plan` (a batch is ready and the step begins),
:func:`sync_plan` (a weight sync), :func:`save_plan` (a model save plugins may veto) and :func:`fit_plan` (the
run: an error is reported once, then ``timeslice_stop``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator

from timeslice_verl.hooks.events import CheckpointEvent, Event, InitWorkersEvent, RolloutEvent, TrainStepEvent, WeightSyncEvent
from timeslice_verl.hooks.lifecycle import Lifecycle
from timeslice_verl.log import get_logger

log = get_logger("adapter")


@dataclass(frozen=True)
class Fire:
    hook: Callable[[Lifecycle, Any], Any]
    """The dispatcher's method for the hook (``Lifecycle.post_rollout``)."""
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


def _do(lc: Lifecycle, step: Any) -> Any:
    """A step other than :data:`CALL`, here (blocking)."""
    if isinstance(step, Fire):
        return step.hook(lc, step.event)
    if isinstance(step, Report):
        return lc.report_exception(step.point, step.error)
    if isinstance(step, Stop):
        return lc.stop(step.reason)
    raise TypeError(f"unknown plan step {step!r}")  # pragma: no cover


def _until_call(lc: Lifecycle, plan: Plan, value: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Do the plan's steps until it asks for verl's call (``(False, None)``) or ends (``(True, its value)``)."""
    while True:
        done, step = _advance(plan, value, error)
        if done or step is CALL:
            return done, step if done else None
        value, error = None, None
        try:
            value = _do(lc, step)
        except BaseException as exc:  # handed to the plan, which re-raises it
            error = exc


async def _auntil_call(lc: Lifecycle, plan: Plan, value: Any, error: BaseException | None) -> tuple[bool, Any]:
    """:func:`_until_call` off the event loop: every hook runs in a worker thread."""
    while True:
        done, step = _advance(plan, value, error)
        if done or step is CALL:
            return done, step if done else None
        value, error = None, None
        try:
            value = await asyncio.to_thread(_do, lc, step)
        except BaseException as exc:
            error = exc


def run(lc: Lifecycle, plan: Plan, call: Callable[[], Any] | None = None) -> Any:
    """Drive ``plan`` from a synchronous method; ``call`` runs verl's original."""
    done, out = _until_call(lc, plan, None, None)
    while not done:
        value, error = None, None
        try:
            value = call() if call is not None else None
        except BaseException as exc:
            error = exc
        done, out = _until_call(lc, plan, value, error)
    return out


async def arun(lc: Lifecycle, plan: Plan, call: Callable[[], Awaitable[Any]]) -> Any:
    """Drive ``plan`` from a coroutine method (hooks run off the event loop)."""
    done, out = await _auntil_call(lc, plan, None, None)
    while not done:
        value, error = None, None
        try:
            value = await call()
        except BaseException as exc:
            error = exc
        done, out = await _auntil_call(lc, plan, value, error)
    return out


class Paused:
    """A plan run up to its :data:`CALL`: verl's own work happens between two of verl's calls into the adapter."""

    def __init__(self, lc: Lifecycle, plan: Plan, done: bool, value: Any) -> None:
        self.lc, self.plan, self.done, self.value = lc, plan, done, value

    def end(self, result: Any = None, error: BaseException | None = None) -> Any:
        """verl's work returned ``result`` (or raised ``error``, which the plan re-raises): the rest of the plan."""
        if self.done:
            return self.value
        self.done, self.value = _until_call(self.lc, self.plan, result, error)
        return self.value

    async def aend(self, result: Any = None, error: BaseException | None = None) -> Any:
        if self.done:
            return self.value
        self.done, self.value = await _auntil_call(self.lc, self.plan, result, error)
        return self.value


def begin(lc: Lifecycle, plan: Plan) -> Paused:
    """Run ``plan`` up to its :data:`CALL` (or to its end, when it never calls: a vetoed save)."""
    return Paused(lc, plan, *_until_call(lc, plan, None, None))


async def abegin(lc: Lifecycle, plan: Plan) -> Paused:
    return Paused(lc, plan, *await _auntil_call(lc, plan, None, None))


# --------------------------------------------------------------------------- the shared plans


def init_plan(lc: Lifecycle) -> Plan:
    """Model loading: begin, verl's call (an error is reported), end with how long it took."""
    t0 = time.monotonic()
    try:
        yield Fire(Lifecycle.init_workers_begin, lc.event(InitWorkersEvent))
        result = yield CALL
    except BaseException as exc:
        yield Report("init_workers", exc)
        raise
    yield Fire(Lifecycle.init_workers_end, lc.event(InitWorkersEvent, elapsed_s=round(time.monotonic() - t0, 6)))
    return result


def sample_plan(rollout: RolloutEvent, step: TrainStepEvent) -> Plan:
    """A batch was handed over (``post_rollout``) and the step touches the GPU next (``pre_train_step``)."""
    yield Fire(Lifecycle.post_rollout, rollout)
    yield Fire(Lifecycle.pre_train_step, step)


def sync_plan(lc: Lifecycle, *, initial: bool, synced: Callable[[Any], bool] = lambda result: True,
              save_follows: Callable[[], bool] = lambda: False,
              before_end: Callable[[bool], None] = lambda synced: None,
              pushed: Callable[[], Any] = lambda: None) -> Plan:
    """A weight sync: begin, verl's call (an error is reported), end with ``synced`` read off its result.
    ``before_end``: what must still use the trainer's GPUs once the weights are synced and before the end is told
    (its plugins may lend the GPUs then). ``pushed``: what the engine moved (a ``Transfer``, or None)."""
    t0 = time.monotonic()
    try:
        yield Fire(Lifecycle.weight_sync_begin, lc.event(WeightSyncEvent, initial=initial))
        result = yield CALL
    except BaseException as exc:
        yield Report("update_weights", exc)
        raise
    done = bool(synced(result))
    before_end(done)
    transfer = pushed()
    yield Fire(Lifecycle.weight_sync_end, lc.event(WeightSyncEvent, initial=initial, synced=done,
                                                   elapsed_s=round(time.monotonic() - t0, 6),
                                                   save_follows=done and not initial and save_follows(),
                                                   pushed_bytes=getattr(transfer, "pushed_bytes", None),
                                                   push_s=getattr(transfer, "push_s", None)))
    return result


def save_plan(lc: Lifecycle, *, force: bool, where: str) -> Plan:
    """A model save: plugins may veto it; the end says whether it saved. Returns whether verl's save ran."""
    allowed = yield Fire(Lifecycle.save_checkpoint_begin, lc.event(CheckpointEvent, force=force))
    if not allowed:
        log.warning("checkpoint save at %s vetoed by a plugin", where)
        yield Fire(Lifecycle.save_checkpoint_end, lc.event(CheckpointEvent, force=force, saved=False, elapsed_s=0.0))
        return None
    t0 = time.monotonic()
    try:
        result = yield CALL
    except BaseException:
        yield Fire(Lifecycle.save_checkpoint_end, lc.event(CheckpointEvent, force=force, saved=False,
                                                           elapsed_s=round(time.monotonic() - t0, 6)))
        raise
    yield Fire(Lifecycle.save_checkpoint_end, lc.event(CheckpointEvent, force=force, saved=True,
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


__all__ = ["CALL", "Fire", "Paused", "Plan", "Report", "Stop", "abegin", "arun", "begin", "fit_plan", "init_plan", "run",
           "sample_plan", "save_plan", "sync_plan"]
