"""The trainer's GPU processes as a handoff sees them: the :class:`Ranks` protocol (verl's worker groups driven by
the trainer's driver, the demo's worker, SPMD ranks that agree over gloo) and what a lost one raises."""

from __future__ import annotations

from typing import Any, Protocol


class RankLost(RuntimeError):
    """A rank or a node's agent failed during a handoff; every node's GPUs were given back."""


class Ranks(Protocol):
    """The trainer's GPU processes as a handoff sees them (one report dict per process)."""

    collective: bool
    """Each rank runs its own handoff and the ranks agree (SPMD); False: one process drives them all (verl)."""

    def can_park(self) -> bool: ...

    def park_reserve(self) -> list[dict[str, Any]]: ...

    def park(self) -> list[dict[str, Any]]:
        """Every rank parks; raises if any rank could not (the others may have parked)."""

    def unpark(self) -> list[dict[str, Any]]: ...

    def release_caches(self) -> list[dict[str, Any]]: ...

    def local_pids(self) -> list[int]: ...

    def agree(self, what: str, error: BaseException | None) -> None:
        """Every rank learns whether the agent's part of ``what`` worked; raises if it did not."""

    def shared(self, value: Any) -> Any:
        """The value of the first rank, on every rank (a decision all ranks must take alike)."""


__all__ = ["RankLost", "Ranks"]
