"""``timeslice.validate.source`` for verl's own trainers (the default): a due version's weights from its GPU ranks.

The snapshot, on the trainer's thread, calls the actor worker group's ``timeslice_policy_snapshot`` (added to verl's
``Worker`` by this package's ``verl.plugins`` entry point, :mod:`timeslice_verl.ranks.policy`): every rank gathers
the full tensors as verl's own weight sync does, rank 0 keeps a copy on its GPU and answers with the CUDA IPC
handles of that copy — so the policy tenant must run on rank 0's GPU. Once pushed, ``timeslice_policy_release``
drops the copy on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from timeslice_verl.names import POLICY_RELEASE, POLICY_SNAPSHOT
from timeslice_verl.weights import Update

GROUPS = ("actor_wg", "actor_rollout_wg")
"""The trainer's attributes that may hold its actor's worker group (PyPI verl's fully-async, v1)."""


class RankSourceError(RuntimeError):
    """The trainer's ranks cannot give their weights; the message names what is missing."""


@dataclass
class RankSnapshot:
    """One version as rank 0 keeps it: its update bodies, and the group that drops it once pushed."""

    version: int
    updates_of_rank0: list[dict[str, Any]]
    group: Any

    def updates(self) -> list[Update]:
        return [Update(u["info"], int(u.get("bytes", 0))) for u in self.updates_of_rank0]

    def release(self) -> None:
        getattr(self.group, POLICY_RELEASE)(self.version)


@dataclass
class RankSource:
    """The weights of ``group``'s ranks (verl's actor worker group)."""

    group: Any

    def snapshot(self, version: int) -> RankSnapshot:
        reports = getattr(self.group, POLICY_SNAPSHOT)(version) or []
        first = [r for r in reports if isinstance(r, dict) and r.get("rank") == 0]
        if not first or not first[0].get("updates"):
            raise RankSourceError(f"verl's rank 0 sent no weights for version {version} (reports: {reports!r:.300})")
        return RankSnapshot(version, first[0]["updates"], self.group)


def ranks(trainer: Any) -> RankSource:
    """The factory ``timeslice.validate.source`` names by default (called with the trainer)."""
    for name in GROUPS:
        group = getattr(trainer, name, None)
        if group is not None:
            if getattr(group, POLICY_SNAPSHOT, None) is None:
                raise RankSourceError(f"trainer.{name} has no {POLICY_SNAPSHOT}: the timeslice-verl package is not "
                                      "installed where verl's workers run (its verl.plugins entry point adds it)")
            return RankSource(group)
    raise RankSourceError(f"the trainer has none of {', '.join(GROUPS)}: name its weight source in "
                          "timeslice.validate.source")


__all__ = ["GROUPS", "RankSnapshot", "RankSource", "RankSourceError", "ranks"]
