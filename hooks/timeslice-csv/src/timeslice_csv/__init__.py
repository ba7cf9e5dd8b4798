"""One CSV row per GPU handoff, from timeslice-verl's ``handoff`` hook."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any

from timeslice_verl import hookimpl

COLUMNS = ["time", "job", "step", "param_version", "action", "point", "waited_ms", "thaw_ms", "freeze_ms", "frozen_gib"]


class CsvHandoffPlugin:
    """Options (``timeslice.plugins.options.csv``): ``path`` (default ``timeslice-handoffs.csv``)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._file: IO[str] | None = None
        self._writer: Any = None

    @hookimpl
    def timeslice_start(self, lifecycle: Any) -> None:
        options = lifecycle.settings.plugins.options.get("csv", {}) or {}
        self.path = Path(options.get("path", "timeslice-handoffs.csv"))
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(COLUMNS)

    @hookimpl
    def handoff(self, event: Any) -> None:
        if self._writer is None:
            return
        parked = max((t.bytes for t in event.transitions if t.action == "freeze"), default=0)
        self._writer.writerow([
            f"{event.time:.3f}", event.job, event.step, event.param_version, event.action, event.point,
            f"{event.waited_s * 1e3:.1f}", f"{event.thaw_s * 1e3:.1f}", f"{event.freeze_s * 1e3:.1f}",
            f"{parked / 2**30:.3f}",
        ])
        self._file.flush()  # type: ignore[union-attr]

    @hookimpl
    def timeslice_stop(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._writer = None, None
