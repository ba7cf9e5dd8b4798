"""The agent's journal: every move it made (a :class:`~timeslice_verl.hooks.events.Transition`), numbered, and who
listens (the metrics exporter). A job's client is told the moves made since it last asked."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from timeslice_verl.hooks.events import Transition
from timeslice_verl.log import get_logger

log = get_logger("agent")

KEEP = 4096
"""Moves kept (a job's client asks at least once a step)."""


class Journal:
    def __init__(self) -> None:
        self.moves: deque[tuple[int, Transition]] = deque(maxlen=KEEP)
        self.seq = 0
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []

    def record(self, action: str, subject: str, start: float, ok: bool, nbytes: int = 0, detail: str = "",
               phases: dict[str, float] | None = None, left: int = 0) -> Transition:
        t = Transition(action=action, subject=subject, start=start, end=time.time(), ok=ok, bytes=nbytes, detail=detail,
                       phases={k: round(v, 6) for k, v in (phases or {}).items()}, left=left)
        self.seq += 1
        self.moves.append((self.seq, t))
        self.notify("transition", t.to_dict())
        return t

    def since(self, seq: int) -> list[Transition]:
        return [t for s, t in self.moves if s > seq]

    def report(self, job: Any) -> list[dict[str, Any]]:
        """The moves since ``job`` last asked (its ``cursor`` moves on)."""
        out = [t.to_dict() for t in self.since(job.cursor)]
        job.cursor = self.seq
        return out

    def notify(self, kind: str, data: dict[str, Any]) -> None:
        for listener in self.listeners:
            try:
                listener(kind, data)
            except Exception:  # pragma: no cover - a metrics bug must not stop the agent
                log.exception("listener failed")

    def last(self, action: str, ok: bool | None = True) -> Transition | None:
        """The latest move of ``action`` that succeeded (``ok``), failed, or either (None): what the status reports of
        the tenant's last yield and wake."""
        return next((t for _, t in reversed(self.moves) if t.action == action and ok in (None, t.ok)), None)

    def median_rate(self, action: str, phase: str) -> float | None:
        """GB/s of the driver's byte-moving phase over the kept moves of ``action`` (``freeze``: checkpoint,
        ``thaw``: restore): the node's measured bandwidth, for the trainer's estimate of a round trip."""
        rates = sorted(t.bytes / 1e9 / t.phases[phase] for _, t in self.moves
                       if t.action == action and t.ok and t.bytes and t.phases.get(phase, 0) > 0.01)
        return round(rates[len(rates) // 2], 3) if rates else None


__all__ = ["Journal"]
