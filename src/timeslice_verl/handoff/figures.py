"""What one handoff did, as the trainer saw it: :class:`HandoffFigures`, and the ``handoff`` event made of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from timeslice_verl.hooks.events import HandoffEvent, Transition


@dataclass
class HandoffFigures:
    """What one handoff did, as the trainer saw it."""

    action: str
    """``acquire``, ``release``, ``skip``, ``crash_release`` or ``prepare``."""
    point: str
    seconds: float = 0.0
    """How long the trainer was blocked (the whole call)."""
    agent_s: float = 0.0
    """The agent's part (0 on ranks that are not the agent's client)."""
    ok: bool = True
    detail: str = ""
    agent: dict[str, Any] = field(default_factory=dict)
    """The agent's reply (``transitions``, ``thawed``, ``thaw_s``…)."""
    memory: dict[str, int] = field(default_factory=dict)
    """Byte totals over ranks after freeing caches (``live``, ``reserved_before``, ``reserved_after``)."""
    swap: str = ""
    """Release: the swap mode; acquire: the mode when ranks unparked, else empty."""
    park: list[dict[str, Any]] = field(default_factory=list)
    """One park or unpark report per rank."""
    early_s: float = 0.0
    """A prepared acquire: how long the GPUs were back before the trainer asked (the forecast was early)."""
    at: float = 0.0
    """When it happened (wall clock; 0: when it is reported). The way back's, reported later, keeps its own."""

    @property
    def park_s(self) -> float:
        """The slowest rank's park or unpark (the trainer waited for it)."""
        return max((float(r.get("seconds", 0.0)) for r in self.park), default=0.0)

    @property
    def parked(self) -> int:
        return sum(int(r.get("parked", 0)) for r in self.park)


def summarize(reports: list[dict[str, Any]]) -> dict[str, int]:
    """Byte totals over ranks: ``live``, ``reserved_before``, ``reserved_after``, ``cupy_freed``."""
    total = {"live": 0, "reserved_before": 0, "reserved_after": 0, "cupy_freed": 0}
    for r in reports:
        total["live"] += int(r.get("live_after", 0))
        total["reserved_before"] += int(r.get("reserved_before", 0))
        total["reserved_after"] += int(r.get("reserved_after", 0))
        total["cupy_freed"] += int(r.get("cupy_before", 0)) - int(r.get("cupy_after", 0))
    return total


def handoff_event(lifecycle: Any, figures: HandoffFigures) -> HandoffEvent:
    """The ``handoff`` event of one handoff's figures (stamped with the trainer's step)."""
    memory = figures.memory
    return lifecycle.event(
        HandoffEvent, time=figures.at or time.time(),
        action=figures.action, point=figures.point, waited_s=round(figures.seconds, 6), ok=figures.ok,
        detail=figures.detail, transitions=tuple(Transition.from_dict(t) for t in figures.agent.get("transitions", [])),
        live_bytes=memory.get("live", 0), reserved_before=memory.get("reserved_before", 0),
        reserved_after=memory.get("reserved_after", 0), swap=figures.swap, parked_bytes=figures.parked,
        park_s=figures.park_s, early_s=round(figures.early_s, 6),
    )


def park_entries(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the agent's release takes of each rank's park report (and, across nodes, the rank's node, which
    tells :class:`~timeslice_verl.handoff.nodes.NodeAgents` whose agent gets it)."""
    return [{"pid": int(r["pid"]), "parked": int(r.get("parked", 0)), "kept": int(r.get("kept", 0)),
             **({"node": r["node"]} if r.get("node") else {})} for r in reports]


def resident_entries(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same for a ``resident`` release: each rank parked nothing and keeps what its allocators still hold
    once their caches are freed (torch's reserved bytes and cupy's pool)."""
    return park_entries([{"pid": r["pid"], "parked": 0, "node": r.get("node", ""),
                          "kept": int(r.get("reserved_after", 0)) + int(r.get("cupy_after", 0))}
                         for r in reports if r.get("pid")])



__all__ = ["HandoffFigures", "handoff_event", "park_entries", "resident_entries", "summarize"]
