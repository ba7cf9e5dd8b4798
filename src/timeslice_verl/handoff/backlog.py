"""verl's backlog, read within a bound: a read that blocks or answers nonsense is "unknown", never a wait.

The backlog source an adapter gives (fully-async's message queue size, v1's replay buffer count) is a call into
verl — a Ray actor, a lock — that may be slow or broken. :class:`Backlog` runs it on a thread of its own and
waits at most ``timeout_s``: the trainer's release and acquire never wait on it longer, and while a read is
still out the next one is "unknown" at once (reads never pile up). An answer that is not two counts is unknown
too.

The thread is one for the trainer's life, not one per read: a source whose first call starts something bound to
the thread that made it must keep it. ``ray.init`` is such a call (a ``ray.get`` on a process without Ray starts
it): Ray's GCS and raylet are started with ``PR_SET_PDEATHSIG``, which Linux fires when the *thread* that forked
them ends — with a thread per read they were SIGKILLed as the first read returned, and the trainer's process
exited at its ``ray.shutdown`` (the test suite's process once ended that way, with no report).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

from timeslice_verl.log import get_logger

log = get_logger("handoff")

READ_TIMEOUT_S = 0.5
FIRST_READ_TIMEOUT_S = 5.0
"""The first read may take longer (verl's queue and its Ray actor warm up): it happens at start-up, when nobody waits."""


def valid(value: Any) -> tuple[int, int] | None:
    """``(queued, required)`` when ``value`` is two non-negative counts, else None."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return int(value[0]), int(value[1])


class Backlog:
    """The backlog source of one trainer, read within a bound (None: no source)."""

    def __init__(self, source: Callable[[], Any] | None, *, timeout_s: float = READ_TIMEOUT_S, job: str = "") -> None:
        self.source, self.timeout_s, self.job = source, timeout_s, job
        self._first = True
        self._lock = threading.Lock()
        self._out: concurrent.futures.Future | None = None
        self._warned: set[str] = set()
        self._reads: queue.SimpleQueue[concurrent.futures.Future] = queue.SimpleQueue()
        self._reader: threading.Thread | None = None

    def read(self) -> tuple[int, int] | None:
        """(queued, required) samples for the next step, or None when unknown (no source, slow, failing, nonsense)."""
        if self.source is None:
            return None
        with self._lock:
            if self._out is not None and not self._out.done():
                return None  # the last read is still out: no second one behind it
            out: concurrent.futures.Future = concurrent.futures.Future()
            self._out = out
            if self._reader is None:
                self._reader = threading.Thread(target=self._serve, daemon=True, name="timeslice-backlog")
                self._reader.start()
        self._reads.put(out)
        bound, self._first = (max(self.timeout_s, FIRST_READ_TIMEOUT_S) if self._first else self.timeout_s), False
        try:
            value = out.result(bound)
        except concurrent.futures.TimeoutError:
            self._warn("slow", f"the backlog read took longer than {bound:g} s: taken as unknown")
            return None
        except Exception as exc:  # a signal, never a reason to fail a handoff
            self._warn("error", f"the backlog is unreadable ({type(exc).__name__}: {exc}): taken as unknown")
            return None
        checked = valid(value)
        if checked is None and value is not None:
            self._warn("shape", f"the backlog source answered {value!r:.80} (not two counts): taken as unknown")
        return checked

    def _serve(self) -> None:
        """The reader: every read, one after the other, on this one thread (a daemon: a hung source never holds
        the process's exit)."""
        while True:
            out = self._reads.get()
            try:
                out.set_result(self.source())  # type: ignore[misc]
            except BaseException as exc:
                out.set_exception(exc)

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:  # once per kind: a broken source is said once, not every 0.1 s
            self._warned.add(kind)
            log.warning("[timeslice] job=%s %s", self.job, message)


__all__ = ["READ_TIMEOUT_S", "Backlog", "valid"]
