"""The trainer's verl workers, seen from the adapters: where they run, and what they free before a freeze.

verl calls a worker-group method on every rank only when the method carries verl's ``register``
mark *before* verl builds its worker classes (``create_colocated_worker_cls`` copies marked methods
into ``WorkerDict``). :func:`install_worker_methods` therefore adds ours to verl's base ``Worker``
the moment ``verl.single_controller.base.worker`` is imported — through the ``verl.plugins`` entry
point, in the trainer actor and in every worker process alike — so no verl class is forked.

Plugins reach this through ``lifecycle.workers`` (:class:`VerlWorkers`), never through verl's
internals.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from typing import Any

from timeslice_verl.log import get_logger
from timeslice_verl.swap_choice import host_available

log = get_logger("adapter.workers")

RELEASE_CACHES = "timeslice_release_caches"
"""Worker-group method (``Dispatch.ONE_TO_ALL``): free this rank's GPU caches, report the bytes."""
PARK, UNPARK, PARK_RESERVE = "timeslice_park", "timeslice_unpark", "timeslice_park_reserve"
"""Worker-group methods (``Dispatch.ONE_TO_ALL``): park/unpark this rank's tensors, pin its host buffer."""
WORKER_MODULE = "verl.single_controller.base.worker"
_GROUPS = ("actor_wg", "actor_rollout_wg", "critic_wg", "ref_policy_wg")


def release_caches_here() -> dict[str, Any]:
    """Free what this process caches on its GPU but does not use, so a freeze moves less.

    Returns bytes before/after: ``live`` (tensors the process holds: what must survive), ``reserved``
    (torch's caching allocator), ``cupy`` (cupy's pool: verl's NCCL weight-sync buffers).
    """
    report: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
    torch = sys.modules.get("torch")
    cuda_ready = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    cupy = sys.modules.get("cupy")
    pool = cupy.get_default_memory_pool() if cupy is not None else None
    if cuda_ready:
        torch.cuda.synchronize()
        report["live_before"] = int(torch.cuda.memory_allocated())
        report["reserved_before"] = int(torch.cuda.memory_reserved())
    if pool is not None:
        report["cupy_before"] = int(pool.total_bytes())
    gc.collect()  # tensors only kept alive by reference cycles go first
    if cuda_ready:
        torch.cuda.empty_cache()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        report["live_after"] = int(torch.cuda.memory_allocated())
        report["reserved_after"] = int(torch.cuda.memory_reserved())
    if pool is not None:
        pool.free_all_blocks()
        report["cupy_after"] = int(pool.total_bytes())
    report["host_available"] = host_available()
    report["node"] = node_id()
    return report


def _worker_release_caches(self: Any) -> dict[str, Any]:  # bound to verl's Worker
    return release_caches_here()


def _parker_here(action: str) -> dict[str, Any]:
    """This process's parker does ``action`` (``reserve``, ``park``, ``unpark``); its report, with the host."""
    from timeslice_verl.park import parker

    return {**getattr(parker(), action)().to_dict(), "host": socket.gethostname(), "node": node_id()}


def _worker_park(self: Any) -> dict[str, Any]:  # bound to verl's Worker
    report = _parker_here("park")
    cupy = sys.modules.get("cupy")
    if cupy is not None:  # verl's NCCL weight-sync buffers come from cupy's pool, not torch's: free its idle blocks too
        pool = cupy.get_default_memory_pool()
        before = int(pool.total_bytes())
        pool.free_all_blocks()
        report["cupy_freed"] = before - int(pool.total_bytes())
    return report


def _worker_unpark(self: Any) -> dict[str, Any]:
    return _parker_here("unpark")


def _worker_park_reserve(self: Any) -> dict[str, Any]:
    return _parker_here("reserve")


_METHODS = {RELEASE_CACHES: _worker_release_caches, PARK: _worker_park, UNPARK: _worker_unpark,
            PARK_RESERVE: _worker_park_reserve}


def install_worker_methods(module: Any) -> None:
    """Give verl's base ``Worker`` our registered methods (idempotent; called on module import)."""
    worker = getattr(module, "Worker", None)
    register = getattr(module, "register", None)
    dispatch = getattr(module, "Dispatch", None)
    if worker is None or register is None or dispatch is None:
        log.warning("timeslice: %s has no Worker/register/Dispatch; worker methods not installed", module.__name__)
        return
    for name, fn in _METHODS.items():
        if name not in worker.__dict__:
            setattr(worker, name, register(dispatch_mode=dispatch.ONE_TO_ALL)(fn))


def _whoami(_actor: Any) -> tuple[str, int, str]:
    return socket.gethostname(), os.getpid(), node_id()


def node_id() -> str:
    """The Ray node this process runs on ("" outside Ray): what tells nodes apart where hostnames do not."""
    ray = sys.modules.get("ray")
    try:
        return str(ray.get_runtime_context().get_node_id()) if ray is not None and ray.is_initialized() else ""
    except Exception:  # an older Ray, or no worker context
        return ""


class VerlWorkers:
    """The GPU worker groups of one verl trainer (``actor_wg`` and friends), for plugins."""

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
            return ray.get([w.__ray_call__.remote(_whoami) for w in handles.values()], timeout=30)
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
        """Every rank parks its tensors in pinned host RAM (see :mod:`timeslice_verl.park`)."""
        return self._on_every_rank(PARK)

    def unpark(self) -> list[dict[str, Any]]:
        """Every rank brings its tensors back (after the agent unlocked it)."""
        return self._on_every_rank(UNPARK)

    def agree(self, what: str, error: BaseException | None) -> None:
        """verl's driver is the only process that talks to the agent: nothing to agree on."""
        if error is not None:
            raise error

