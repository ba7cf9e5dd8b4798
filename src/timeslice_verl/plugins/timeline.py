"""The timeline plugin: every lifecycle event and every agent transition, one JSON object a line.

The file is appended to and flushed per record, so a crashed run still leaves its timeline;
``timeslice-verl timeline plot run.jsonl`` turns it into a picture and a summary.
Record shape: ``{"hook": <hook name>, "kind": <event kind>, "job": …, "time": …, <event fields>}``;
each transition a handoff carries is also written as its own ``{"hook": "transition", …}`` record.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO, Any

from timeslice_verl.hooks.events import Event, HandoffEvent, RunEvent
from timeslice_verl.hooks.spec import hook_names, hookimpl
from timeslice_verl.log import get_logger

log = get_logger("timeline")


class TimelinePlugin:
    name = "timeline"

    def __init__(self) -> None:
        self.path: Path | None = None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str, separators=(",", ":")) + "\n"
        with self._lock:  # a validation's record comes from its own thread
            if self._file is None:
                return
            self._file.write(line)
            self._file.flush()

    def record(self, hook: str, event: Event) -> None:
        self._write({"hook": hook, **event.to_dict()})
        if isinstance(event, HandoffEvent):
            for t in event.transitions:
                self._write({"hook": "transition", "kind": "transition", "job": event.job, **t.to_dict()})

    @hookimpl
    def timeslice_start(self, event: RunEvent, lifecycle: Any) -> None:
        self.path = Path(lifecycle.settings.timeline.path).expanduser()
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        log.info("timeline: appending to %s (pid %d)", self.path.resolve(), os.getpid())
        self.record("timeslice_start", event)

    @hookimpl(trylast=True)  # after the agent plugin's last release is recorded
    def timeslice_stop(self, event: RunEvent) -> None:
        self.record("timeslice_stop", event)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _recorder(hook: str):
    def impl(self: TimelinePlugin, event: Event) -> None:
        self.record(hook, event)

    impl.__name__ = hook
    impl.__doc__ = f"Append ``{hook}`` to the timeline."
    return hookimpl(impl)


for _hook in hook_names():
    if _hook not in ("timeslice_start", "timeslice_stop"):
        setattr(TimelinePlugin, _hook, _recorder(_hook))
