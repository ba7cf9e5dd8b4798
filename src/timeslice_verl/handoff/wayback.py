"""The way back, ahead of need: a thread that brings the trainer's GPUs back before its batch is complete.

Started at each release; it watches the valley (the backlog when the adapter gives one — the samples still
missing, and how long since the last one came — else the time since the release) and, ``lead`` seconds
before the valley's forecast end, runs the handoff's way back: with a
park swap the whole acquire and every rank's unpark (so the trainer's acquire then waits for nothing), with a
checkpoint swap the agent's ``prepare`` (so the acquire waits only for the agent's reply). The trainer's
acquire stops a way back not yet started and joins one under way.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from timeslice_verl.log import get_logger
from timeslice_verl.valley import ValleyForecast

log = get_logger("handoff")

POLL_S = 0.25
"""How often the backlog is read while the valley lasts."""


class WayBack:
    def __init__(self, forecast: ValleyForecast, backlog: Callable[[], tuple[int, int] | None],
                 bring_back: Callable[[str], None]) -> None:
        self.forecast, self.backlog, self.bring_back = forecast, backlog, bring_back
        self.error: BaseException | None = None
        """What the last way back raised (the trainer's acquire re-raises what it cannot recover from)."""
        self.fired_at: float | None = None
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Watch the valley that begins now (a previous watch is stopped first)."""
        self.stop()
        self.error, self.fired_at = None, None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._cancel, time.monotonic()), daemon=True,
                                        name="timeslice-wayback")
        self._thread.start()

    def stop(self) -> None:
        """Cancel a way back that has not started; wait for one that has."""
        with self._lock:
            self._cancel.set()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _due_in(self, released: float, seen: dict) -> float | None:
        backlog = self.backlog()
        now = time.monotonic()
        if backlog is not None:
            if backlog != seen.get("backlog"):  # a sample arrived (polled: up to POLL_S late)
                seen["backlog"], seen["at"] = backlog, now if "backlog" in seen else released
            due = self.forecast.due_in(backlog, since_s=now - seen["at"])
            if due is not None:
                return due
        delay = self.forecast.delay()
        return None if delay is None else max(0.0, released + delay - now)

    def _run(self, cancel: threading.Event, released: float) -> None:
        seen: dict = {}  # the backlog last read, and since when it stood still
        while True:
            due = self._due_in(released, seen)
            if due is None:
                return  # nothing to go on yet: the acquire does the way back
            if due > 0:
                if cancel.wait(min(due, POLL_S)):
                    return
                continue
            with self._lock:
                if cancel.is_set():
                    return
                self.fired_at = time.monotonic()
            try:
                self.bring_back("prepare")
            except BaseException as exc:  # the trainer's acquire sees it
                self.error = exc
                log.warning("[timeslice] the way back ahead of need failed (the acquire tries again): %s", exc)
            return


__all__ = ["POLL_S", "WayBack"]
