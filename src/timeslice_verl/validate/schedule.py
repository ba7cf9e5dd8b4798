"""Which versions are validated, and when: pure (versions in, moves out; the runner does the I/O).

A version is due when it is a multiple of ``every`` (verl's ``trainer.test_freq``). One validation runs at a time
on the policy tenant, so a due version meets one of three situations:

* nothing runs: **push** it now (its weights into the policy tenant) and submit its run;
* a run is under way: **hold** it (its weights kept aside) until that run ends — and report the running one as late
  (it could not finish before the next was due);
* a version is already held: the older held one is **superseded** — reported, never silently dropped or merged —
  and the newer is held instead (validation follows the trainer; the trainer never waits for it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Move(str, enum.Enum):
    none = "none"
    """Not a due version."""
    push = "push"
    """Push it and submit its run now."""
    hold = "hold"
    """Keep its weights until the run under way ends."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Late:
    """A validation that could not keep up: ``version``'s run was still under way (``superseded=False``) or still
    held (``superseded=True``) when ``due`` was due."""

    version: int
    due: int
    superseded: bool = False

    def __str__(self) -> str:
        what = "was still held (its run never started: superseded)" if self.superseded else "was still running"
        return f"the validation of version {self.version} {what} when version {self.due} was due"


@dataclass
class Schedule:
    every: int
    running: int | None = None
    held: int | None = None
    late: list[Late] = field(default_factory=list)
    done: list[int] = field(default_factory=list)

    def due(self, version: int) -> bool:
        return self.every > 0 and version > 0 and version % self.every == 0

    def synced(self, version: int, force: bool = False) -> Move:
        """The trainer's weights are now ``version``: what to do with it (``force``: though it is not due)."""
        if not (force or self.due(version)) or version in (self.running, self.held) or version in self.done:
            return Move.none
        if self.running is None:
            self.running = version
            return Move.push
        self.late.append(Late(self.running, version))
        if self.held is not None:
            self.late.append(Late(self.held, version, superseded=True))
        self.held = version
        return Move.hold

    def finished(self, version: int) -> int | None:
        """``version``'s run ended (answered, or failed for good): the held version to push next, if any (it is then
        the running one)."""
        if version != self.running:
            return None
        self.done.append(version)
        self.running, self.held = self.held, None
        return self.running


__all__ = ["Late", "Move", "Schedule"]
