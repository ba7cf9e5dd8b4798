"""Each verl rank's part of a validation's weights: a due version's full tensors, kept on rank 0's GPU until
the policy tenant has them.

verl's FSDP ranks each hold a shard; the engine's ``get_per_tensor_param()`` (verl ≥ 0.9's engine workers, the one
verl's own weight sync to the rollouter uses) gathers the full tensors one at a time, a collective every rank must
take part in. Rank 0 keeps a copy of each (the next step changes the originals: the copy is the version) and answers
with vLLM ``update_info`` bodies of CUDA IPC handles to those copies; the driver posts them to the policy tenant on
rank 0's GPU and, once pushed, has every rank drop what it kept. The copy costs a model's size on rank 0's GPU from
the snapshot to the push; the gather is the trainer's only cost, the same as one weight sync.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Iterator

from timeslice_verl.log import get_logger
from timeslice_verl.names import POLICY_RELEASE, POLICY_SNAPSHOT
from timeslice_verl.weights import ipc_updates

log = get_logger("ranks")

_KEPT: dict[int, list[tuple[str, Any]]] = {}
"""Version → the full tensors rank 0 keeps until the push."""


def full_tensors(worker: Any) -> Iterator[tuple[str, Any]]:
    """(name, full tensor) of the worker's actor, gathered one at a time (every rank must iterate all of them)."""
    engine = getattr(getattr(worker, "actor", None), "engine", None)
    get = getattr(engine, "get_per_tensor_param", None)
    if get is None:
        raise RuntimeError(f"{type(worker).__name__} has no actor engine with get_per_tensor_param (verl >= 0.9's "
                           "engine workers): its weights cannot be sent to a policy tenant")
    params, _ = get()
    return iter(params)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def snapshot_here(worker: Any, version: int, rank: int | None = None) -> dict[str, Any]:
    """Take part in gathering ``version``'s tensors; rank 0 keeps them and answers with their update bodies."""
    rank = _rank() if rank is None else rank
    kept = [(name, tensor.detach().clone()) if rank == 0 else (name, None) for name, tensor in full_tensors(worker)]
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "version": version,
                              "tensors": len(kept), "updates": []}
    if rank != 0:
        return report
    _KEPT.pop(version, None)
    _KEPT[version] = kept
    try:
        updates = list(ipc_updates(kept))
    except Exception:
        _KEPT.pop(version, None)
        raise
    report["updates"] = [{"info": u.info, "bytes": u.bytes} for u in updates]
    report["bytes"] = sum(u.bytes for u in updates)
    log.info("[timeslice] rank 0 keeps version %d for the policy tenant: %d tensors, %.2f GB", version, len(kept),
             report["bytes"] / 1e9)
    return report


def exported() -> set[int]:
    """Data pointers of the storages kept for the policy tenant: vLLM holds IPC handles to them until the push, so a
    park (:mod:`~timeslice_verl.ranks.park`) never moves them."""
    return {t.untyped_storage().data_ptr() for kept in _KEPT.values() for _, t in kept if t is not None}


def release_here(worker: Any, version: int) -> dict[str, Any]:
    """Drop what this rank kept of ``version`` (nothing on ranks but 0)."""
    kept = _KEPT.pop(version, None)
    return {"pid": os.getpid(), "version": version, "released": kept is not None}


def _worker_snapshot(self: Any, version: int) -> dict[str, Any]:  # bound to verl's Worker
    return snapshot_here(self, version)


def _worker_release(self: Any, version: int) -> dict[str, Any]:
    return release_here(self, version)


METHODS = {POLICY_SNAPSHOT: _worker_snapshot, POLICY_RELEASE: _worker_release}
"""The worker-group methods :func:`~timeslice_verl.ranks.worker.install_worker_methods` adds (``ONE_TO_ALL``)."""

__all__ = ["METHODS", "exported", "full_tensors", "release_here", "snapshot_here"]
