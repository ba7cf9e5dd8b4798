"""The dispatcher: how one trainer process calls its hook plugins.

A :class:`Lifecycle` is built inside the process that fires events (the trainer actor), never
pickled. It owns the plugin manager and applies the rules of docs/architecture.md §3:

* ``timeslice_start`` fires once, before the first event; ``timeslice_stop`` once at the end;
* hooks are called one plugin at a time; in a **gating** hook the first error propagates (an
  acquire that failed must stop the trainer), in an **observing** hook a raising plugin is logged
  with its name and the others still run;
* :meth:`fire` runs the whole call in a worker thread (``asyncio.to_thread``) so a hook that
  blocks for minutes never stalls the trainer actor's event loop;
* ``trainer_exception`` fires once per exception object, however many seams it crosses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, TypeVar

from timeslice_verl.config import TimesliceSettings
from timeslice_verl.events import Event, ExceptionEvent, RunEvent
from timeslice_verl.hookspecs import GATING_HOOKS
from timeslice_verl.log import get_logger
from timeslice_verl.manager import TimesliceManager

log = get_logger("lifecycle")
trace_log = get_logger("trace")

E = TypeVar("E", bound=Event)


def _off_the_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, in a worker thread when this thread runs an event loop (this one waits)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="timeslice-hook") as pool:
        return pool.submit(fn, *args).result()
_REPORTED_ATTR = "__timeslice_reported__"


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
        workers: Any = None,
        backlog: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.trainer = trainer
        self.adapter = adapter
        self.job = settings.job
        self._progress = progress
        manager.trace(trace_log, enabled=lambda: self.settings.plugins.trace)
        self.workers = workers
        """The trainer's GPU workers as the adapter sees them (``local_pids()``, ``release_caches()``),
        or None outside verl."""
        self.backlog = backlog
        """(queued, required): samples ready for the trainer's next step and samples it needs, read off verl
        (fully-async's message queue, v1's replay buffer); None where the adapter has no such signal."""
        self._lock = threading.RLock()
        self._pending: list[tuple[str, Event]] = []
        """Notifications from a thread that found another inside a hook call (see :meth:`notify`)."""
        self._pending_lock = threading.Lock()
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

    # ------------------------------------------------------------------ events

    def event(self, cls: type[E], **fields: Any) -> E:
        """A record of ``cls`` stamped with the job, the trainer's step and param version, and now."""
        step, version = self._progress(self.trainer)
        fields.setdefault("step", step)
        fields.setdefault("param_version", version)
        return cls(job=self.job, **fields)

    def call(self, hook: str, event: Event) -> list[Any]:
        """Call ``hook`` on every plugin and return the non-None results.

        Never on a thread that runs an event loop (a synchronous verl method called from the trainer
        actor's loop): then the call moves to a worker thread and this one waits for it, so plugins
        may block or run their own ``asyncio.run`` as the hookspec promises.
        """
        return _off_the_loop(self._call_here, hook, event)

    def _call_here(self, hook: str, event: Event) -> list[Any]:
        try:
            with self._lock:
                if hook != "timeslice_start":
                    self._ensure_started()
                return self._call(hook, {"trainer": self.trainer, "event": event})
        finally:
            self._deliver()  # what other threads notified while this call held the lock

    async def fire(self, hook: str, event: Event) -> list[Any]:
        """:meth:`call` in a worker thread: the event loop keeps running while plugins block."""
        return await asyncio.to_thread(self.call, hook, event)

    def notify(self, hook: str, event: Event) -> None:
        """For plugins that report events of their own (``handoff``): observing, never raises, never waits for
        another thread's hook call. A background thread (the way back) may report while the trainer's thread is
        inside a hook that waits for that very thread (its acquire joins the way back): then the event is left
        for the trainer's thread, which delivers it when its call returns (the event keeps its own time)."""
        if hook in GATING_HOOKS:
            raise ValueError(f"notify() is for observing hooks; {hook!r} is gating")
        with self._pending_lock:
            self._pending.append((hook, event))
        _off_the_loop(self._deliver)

    def _deliver(self) -> None:
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
            if not self._lock.acquire(blocking=False):
                return  # the thread inside a hook call delivers them when it returns
            try:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                for hook, event in batch:
                    if self._started and not self._closed:  # the final release comes during timeslice_stop
                        self._call(hook, {"trainer": self.trainer, "event": event})
            finally:
                self._lock.release()

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
            self._call("timeslice_start", {"trainer": self.trainer, "event": event, "lifecycle": self})
        except BaseException as exc:
            self._start_error = exc
            raise
        self._started = True

    def stop(self, reason: str = "finished") -> None:
        """Fire ``timeslice_stop`` once (only if time-slicing started)."""
        _off_the_loop(self._stop_here, reason)

    def _stop_here(self, reason: str) -> None:
        self._deliver()
        with self._lock:
            if self._stopped or not self._started:
                self._stopped = True
                return
            self._stopped = True
            try:
                self._call("timeslice_stop", {"trainer": self.trainer, "event": self.event(RunEvent, adapter=self.adapter, reason=reason)})
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
                self.call("trainer_exception", event)
            except BaseException as hook_exc:  # pragma: no cover - observing hooks do not raise
                log.error("trainer_exception hooks failed: %r (original error: %r)", hook_exc, exc)
            return True

    async def areport_exception(self, point: str, exc: BaseException) -> bool:
        return await asyncio.to_thread(self.report_exception, point, exc)

    # ------------------------------------------------------------------ the call itself

    def _call(self, hook: str, kwargs: dict[str, Any]) -> list[Any]:
        """The one dispatch path: pluggy calls the plugins; each implementation carries the hook's
        error policy (see :meth:`TimesliceManager.register`), pluggy's monitoring the tracing."""
        return self.manager.call(hook, **kwargs)


__all__ = ["Lifecycle"]
