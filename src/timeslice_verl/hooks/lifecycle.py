"""The dispatcher: how one trainer process calls its hook plugins, through a typed facade.

A :class:`Lifecycle` is built inside the process that fires events (the trainer actor), never
pickled. It owns the plugin manager and applies the rules of docs/architecture.md §3:

* every hook is fired through a method of its own name (``lifecycle.post_rollout(event)``, as tox 4's
  manager does): a misspelled hook fails at import, not at run time, and the event's type is declared;
  no other module names a hook by a string;
* ``timeslice_start`` fires once, before the first event; ``timeslice_stop`` once at the end;
* hooks are called one plugin at a time; in a **gating** hook the first error propagates (an
  acquire that failed must stop the trainer), in an **observing** hook a raising plugin is logged
  with its name and the others still run;
* :meth:`fire` runs a hook in a worker thread (``asyncio.to_thread``) so a hook that blocks for minutes
  never stalls the trainer actor's event loop; a synchronous call from a thread that runs a loop moves to a
  worker thread too;
* ``trainer_exception`` fires once per exception object, however many seams it crosses.

Only the thread that fires a hook reports what its plugins did (``lifecycle.handoff(event)`` from inside the
call): the way back ahead of need hands its result to the trainer's thread instead of reporting it itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, TypeVar

from timeslice_verl.config.schema import TimesliceSettings
from timeslice_verl.hooks.events import (
    CheckpointEvent,
    Event,
    ExceptionEvent,
    HandoffEvent,
    InitWorkersEvent,
    RolloutEvent,
    RunEvent,
    TrainStepEvent,
    ValidationEvent,
    WeightSyncEvent,
)
from timeslice_verl.hooks.manager import TimesliceManager
from timeslice_verl.log import get_logger

log = get_logger("lifecycle")
trace_log = get_logger("trace")

E = TypeVar("E", bound=Event)
R = TypeVar("R")
_REPORTED_ATTR = "__timeslice_reported__"


def _off_the_loop(fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, in a worker thread when this thread runs an event loop (this one waits)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="timeslice-hook") as pool:
        return pool.submit(fn, *args).result()


def _default_progress(trainer: Any) -> tuple[int, int]:
    return int(getattr(trainer, "global_steps", 0) or 0), int(getattr(trainer, "current_param_version", 0) or 0)


class Lifecycle:
    """The plugin manager of one trainer process plus the rules for calling it."""

    def __init__(
        self,
        settings: TimesliceSettings,
        manager: TimesliceManager,
        *,
        trainer: Any = None,
        adapter: str = "",
        progress: Callable[[Any], tuple[int, int]] = _default_progress,
        ranks: Any = None,
        backlog: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.trainer = trainer
        self.adapter = adapter
        self.job = settings.job
        self._progress = progress
        manager.trace(trace_log, enabled=lambda: self.settings.plugins.trace)
        self.ranks = ranks
        """The trainer's GPU ranks as the adapter sees them (``local_pids()``, ``release_caches()``, ``park()``…),
        or None outside verl."""
        self.backlog = backlog
        """(queued, required): samples ready for the trainer's next step and samples it needs, read off verl
        (fully-async's message queue, v1's replay buffer); None where the adapter has no such signal."""
        self._lock = threading.RLock()
        self._closed = False
        """timeslice_stop has returned: nothing reaches the plugins any more."""
        self._started = False
        self._start_error: BaseException | None = None
        self._stopped = False
        self._reported: set[int] = set()

    @classmethod
    def build(cls, settings: TimesliceSettings, *, trainer: Any = None, adapter: str = "", **kwargs: Any) -> Lifecycle:
        """Load the plugins ``settings.plugins`` asks for into a new manager (in this process)."""
        manager = TimesliceManager().load(settings.plugins)
        names = ", ".join(f"{p.name} ({p.source})" for p in manager.plugins())
        log.info("job=%s adapter=%s plugins: %s", settings.job, adapter or "-", names or "none")
        return cls(settings, manager, trainer=trainer, adapter=adapter, **kwargs)

    def event(self, cls: type[E], **fields: Any) -> E:
        """A record of ``cls`` stamped with the job, the trainer's step and param version, and now."""
        step, version = self._progress(self.trainer)
        fields.setdefault("step", step)
        fields.setdefault("param_version", version)
        return cls(job=self.job, **fields)

    # ------------------------------------------------------------------ the typed facade: one method per hook

    def init_workers_begin(self, event: InitWorkersEvent) -> None:
        self._fire("init_workers_begin", event)

    def init_workers_end(self, event: InitWorkersEvent) -> None:
        self._fire("init_workers_end", event)

    def post_rollout(self, event: RolloutEvent) -> None:
        self._fire("post_rollout", event)

    def pre_train_step(self, event: TrainStepEvent) -> None:
        self._fire("pre_train_step", event)

    def weight_sync_begin(self, event: WeightSyncEvent) -> None:
        self._fire("weight_sync_begin", event)

    def weight_sync_end(self, event: WeightSyncEvent) -> None:
        self._fire("weight_sync_end", event)

    def save_checkpoint_begin(self, event: CheckpointEvent) -> bool:
        """Whether the save may run (False: a plugin vetoed it)."""
        return False not in self._fire("save_checkpoint_begin", event)

    def save_checkpoint_end(self, event: CheckpointEvent) -> None:
        self._fire("save_checkpoint_end", event)

    def handoff(self, event: HandoffEvent) -> None:
        """Report a handoff (observing: the agent plugin reports its own, from inside the hook that caused it)."""
        self._fire("handoff", event)

    def validation_end(self, event: ValidationEvent) -> None:
        """Report a validation run that ended (from the validation's own thread)."""
        self._fire("validation_end", event)

    async def fire(self, hook: Callable[[E], R], event: E) -> R:
        """``await lifecycle.fire(lifecycle.pre_train_step, event)``: the hook in a worker thread, so the event
        loop keeps running while plugins block."""
        return await asyncio.to_thread(hook, event)

    def _fire(self, hook: str, event: Event) -> list[Any]:
        """Call ``hook`` on every plugin (never on a thread that runs an event loop: then in a worker thread,
        so plugins may block or run their own ``asyncio.run`` as the hookspec promises)."""
        return _off_the_loop(self._fire_here, hook, event)

    def _fire_here(self, hook: str, event: Event) -> list[Any]:
        with self._lock:
            if self._closed:  # a report after the end (a late handoff): nobody listens any more
                return []
            self._ensure_started()
            return self.manager.call(hook, trainer=self.trainer, event=event)

    # ------------------------------------------------------------------ start / stop / errors

    def start(self) -> None:
        _off_the_loop(self._start_here)

    def _start_here(self) -> None:
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._started:
            return
        if self._start_error is not None:  # no event reaches half-started plugins
            raise RuntimeError(f"timeslice did not start ({self._start_error!r}); no further events") from self._start_error
        event = self.event(RunEvent, adapter=self.adapter)
        try:
            self.manager.call("timeslice_start", trainer=self.trainer, event=event, lifecycle=self)
        except BaseException as exc:
            self._start_error = exc
            raise
        self._started = True

    def stop(self, reason: str = "finished") -> None:
        """Fire ``timeslice_stop`` once (only if time-slicing started)."""
        _off_the_loop(self._stop_here, reason)

    def _stop_here(self, reason: str) -> None:
        with self._lock:
            if self._stopped or not self._started:
                self._stopped = True
                return
            self._stopped = True
            try:
                event = self.event(RunEvent, adapter=self.adapter, reason=reason)
                self.manager.call("timeslice_stop", trainer=self.trainer, event=event)
            finally:
                self._closed = True

    async def astop(self, reason: str = "finished") -> None:
        await asyncio.to_thread(self.stop, reason)

    def already_reported(self, exc: BaseException) -> bool:
        if getattr(exc, _REPORTED_ATTR, False):
            return True
        return id(exc) in self._reported

    def report_exception(self, point: str, exc: BaseException) -> bool:
        """Fire ``trainer_exception`` for ``exc`` unless it was already reported. Never raises."""
        return bool(_off_the_loop(self._report_here, point, exc))

    def _report_here(self, point: str, exc: BaseException) -> bool:
        with self._lock:
            if self.already_reported(exc):
                return False
            try:
                setattr(exc, _REPORTED_ATTR, True)
            except Exception:  # exceptions without a __dict__
                self._reported.add(id(exc))
            event = self.event(
                ExceptionEvent, point=point, error_type=type(exc).__name__, message=str(exc)[:2000], error=exc
            )
            try:
                self._fire_here("trainer_exception", event)
            except BaseException as hook_exc:  # pragma: no cover - observing hooks do not raise
                log.error("trainer_exception hooks failed: %r (original error: %r)", hook_exc, exc)
            return True

    async def areport_exception(self, point: str, exc: BaseException) -> bool:
        return await asyncio.to_thread(self.report_exception, point, exc)


__all__ = ["Lifecycle"]
