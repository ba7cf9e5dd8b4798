"""The trainer's verl workers seen from its driver: where they run, and every rank's part of a handoff.

Plugins reach this through ``lifecycle.ranks`` (:class:`VerlRanks`), never through verl's internals; what each
rank runs is :mod:`timeslice_verl.ranks.worker`.
"""

from __future__ import annotations

import socket
from typing import Any

from timeslice_verl.log import get_logger
from timeslice_verl.ranks.worker import PARK, PARK_RESERVE, RELEASE_CACHES, UNPARK, whoami

log = get_logger("adapter.workers")

WORKER_MODULE = "verl.single_controller.base.worker"
"""verl's module of the base ``Worker`` class, which gets the rank methods on import."""
_GROUPS = ("actor_wg", "actor_rollout_wg", "critic_wg", "ref_policy_wg")
WHOAMI_TIMEOUT_S = 30.0
"""How long the workers' pid lookup may take (a started actor answers at once; a loaded node takes longer)."""


class VerlRanks:
    """The GPU worker groups of one verl trainer (``actor_wg`` and friends), for plugins."""

    collective = False
    """One process (the trainer's driver) drives every rank: nothing to agree on."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def groups(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for name in _GROUPS:
            group = getattr(self.trainer, name, None)
            if group is not None:
                seen.setdefault(id(group), group)
        return list(seen.values())

    def local_pids(self) -> list[int]:
        """PIDs of the workers on this node (best effort: [] when Ray cannot tell)."""
        here = socket.gethostname()
        return sorted({pid for host, pid, _ in self._whoami() if host == here})

    def node_pids(self) -> dict[str, list[int]]:
        """PIDs of the workers per Ray node id (for a job that spans nodes)."""
        out: dict[str, list[int]] = {}
        for _, pid, node in self._whoami():
            out.setdefault(node, []).append(pid)
        return {node: sorted(set(pids)) for node, pids in out.items()}

    def _whoami(self) -> list[tuple[str, int, str]]:
        handles = {id(w): w for g in self.groups() for w in (getattr(g, "workers", None) or [])}
        if not handles:
            return []
        try:
            import ray

            if not ray.is_initialized():
                return []
            return ray.get([w.__ray_call__.remote(whoami) for w in handles.values()], timeout=WHOAMI_TIMEOUT_S)
        except Exception as exc:  # not a Ray worker group, Ray too old, worker gone…
            log.debug("worker pid lookup failed: %s", exc)
            return []

    def _on_every_rank(self, name: str) -> list[dict[str, Any]]:
        """Call a worker-group method on every rank; one report per worker process ([] without the method)."""
        reports: dict[int, dict[str, Any]] = {}
        for group in self.groups():
            method = getattr(group, name, None)
            if method is None:
                continue
            for report in method() or []:
                if isinstance(report, dict):
                    reports.setdefault(int(report.get("pid", 0)), report)
        return list(reports.values())

    def release_caches(self) -> list[dict[str, Any]]:
        """Every rank frees its caches (one report per worker process); [] when verl lacks the method."""
        return self._on_every_rank(RELEASE_CACHES)

    def can_park(self) -> bool:
        return any(getattr(g, PARK, None) is not None for g in self.groups())

    def park_reserve(self) -> list[dict[str, Any]]:
        """Every rank pins its host buffer (slow, once: at ``init_workers_end``)."""
        return self._on_every_rank(PARK_RESERVE)

    def park(self) -> list[dict[str, Any]]:
        """Every rank parks its tensors in pinned host RAM (see :mod:`timeslice_verl.ranks.park`)."""
        return self._on_every_rank(PARK)

    def unpark(self) -> list[dict[str, Any]]:
        """Every rank brings its tensors back (after the agent unlocked it)."""
        return self._on_every_rank(UNPARK)

    def agree(self, what: str, error: BaseException | None) -> None:
        """verl's driver is the only process that talks to the agent: nothing to agree on."""
        if error is not None:
            raise error

