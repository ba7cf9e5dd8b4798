"""What runs inside each GPU rank: free caches, park, unpark, and the report of what a rank holds.

verl calls a worker-group method on every rank only when the method carries verl's ``register`` mark *before*
verl builds its worker classes (``create_colocated_worker_cls`` copies marked methods into ``WorkerDict``).
:func:`install_worker_methods` therefore adds ours to verl's base ``Worker`` (the module is handed in: nothing
here imports verl) the moment ``verl.single_controller.base.worker`` is imported — through the ``verl.plugins``
entry point, in the trainer actor and in every worker process alike — so no verl class is forked. The demo's
worker and SPMD ranks call the same functions directly.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from typing import Any, Callable, Iterable

from timeslice_verl.log import get_logger
from timeslice_verl.names import JOB_TAG_ENV
from timeslice_verl.ranks.policy import METHODS as POLICY_METHODS

log = get_logger("ranks")


def host_available() -> int:
    """Host RAM the kernel says can be taken without swapping (``MemAvailable``), bytes; 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


RELEASE_CACHES = "timeslice_release_caches"
"""Worker-group method (``Dispatch.ONE_TO_ALL``): free this rank's GPU caches, report the bytes."""
PARK, UNPARK, PARK_RESERVE = "timeslice_park", "timeslice_unpark", "timeslice_park_reserve"
"""Worker-group methods (``Dispatch.ONE_TO_ALL``): park/unpark this rank's tensors, pin its host buffer."""


_COLLECTED_AT: list[int | None] = [None]
"""GPU bytes live in this process right after its last full collection (None: none yet)."""
_NVML_HANDLES: dict[int, Any] = {}


def collect_if_grown(allocated: Callable[[], int] | None) -> bool:
    """A full ``gc.collect`` only when it can free GPU memory: the first time, and whenever the GPU bytes live
    (``allocated()``) grew since the last one (only then can reference cycles hold tensors). A full collection takes
    a tenth of a second or more in a process that imported torch, more in a verl worker: every release paid it
    for nothing in a steady training loop. Without CUDA (None) there is nothing to compare: always."""
    live, last = (allocated() if allocated else None), _COLLECTED_AT[0]
    if live is not None and last is not None and live <= last:
        _COLLECTED_AT[0] = live  # less live than after the last collection: growth counts from here
        return False
    gc.collect()
    if allocated is not None:
        _COLLECTED_AT[0] = allocated()
    return True


def release_caches_here() -> dict[str, Any]:
    """Free what this process caches on its GPU but does not use, so a freeze moves less.

    Returns bytes before/after: ``live`` (tensors the process holds: what must survive), ``reserved``
    (torch's caching allocator), ``cupy`` (cupy's pool: verl's NCCL weight-sync buffers).
    """
    t0 = time.perf_counter()
    report: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
    torch = sys.modules.get("torch")
    cuda_ready = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    cupy = sys.modules.get("cupy")
    pool = cupy.get_default_memory_pool() if cupy is not None else None
    if cuda_ready:
        torch.cuda.synchronize()  # the step's last kernels: the trainer's own GPU time, not the handoff's
        report["sync_s"] = round(time.perf_counter() - t0, 6)
        report["live_before"] = int(torch.cuda.memory_allocated())
        report["reserved_before"] = int(torch.cuda.memory_reserved())
    if pool is not None:
        report["cupy_before"] = int(pool.total_bytes())
    report["collected"] = collect_if_grown(torch.cuda.memory_allocated if cuda_ready else None)  # cycles' tensors go
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
    if cuda_ready:
        report.update(device_footprint(torch.cuda.current_device()))
    report["seconds"] = round(time.perf_counter() - t0, 6)
    return report


def device_footprint(index: int) -> dict[str, int]:
    """What NVML says this process uses on its GPU (context and libraries included), what the job's other processes
    there use (``device_others``) and the GPU's memory: what ``swap=auto`` weighs against the tenant's footprint.
    Empty without NVML."""
    try:
        import pynvml

        handle = _NVML_HANDLES.get(index)
        if handle is None:  # once per process: every release asks
            pynvml.nvmlInit()
            uuid = _uuid(index)
            handle = _NVML_HANDLES[index] = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else
                                             pynvml.nvmlDeviceGetHandleByIndex(index))
        usage = [(int(p.pid), int(p.usedGpuMemory)) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                 if isinstance(p.usedGpuMemory, int)]
        return {"device_used": sum(used for pid, used in usage if pid == os.getpid()),
                "device_others": job_others(usage, os.getpid(), os.environ.get(JOB_TAG_ENV), job_tag),
                "device_total": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)}
    except Exception as exc:  # no NVML, another container's PID namespace…: auto does not choose resident
        log.debug("NVML footprint unknown: %s", exc)
        return {}


def job_others(usage: Iterable[tuple[int, int]], me: int, job: str | None, tag_of: Callable[[int], str | None]) -> int:
    """Bytes the job's other processes hold on this GPU (``usage``: NVML's pid and bytes there): verl's rollouter, its
    vLLM, the rollout side's CheckpointEngineWorker — tagged with the job, never frozen (the agent freezes the trainer's
    ranks), so they stay beside the tenant whatever the swap. 0 for an untagged process (nothing to tell them by)."""
    if not job:
        return 0
    return sum(used for pid, used in usage if pid != me and tag_of(pid) == job)


def job_tag(pid: int) -> str | None:
    """``TIMESLICE_JOB`` in ``pid``'s environment, or None (untagged, gone, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    prefix = JOB_TAG_ENV.encode() + b"="
    return next((e[len(prefix):].decode(errors="replace") for e in entries if e.startswith(prefix)), None)


def _uuid(index: int) -> str:
    """The NVML UUID of CUDA device ``index`` (CUDA_VISIBLE_DEVICES renumbers what NVML numbers by the machine)."""
    torch = sys.modules.get("torch")
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)  # type: ignore[union-attr]
    except Exception:
        return ""
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def _worker_release_caches(self: Any) -> dict[str, Any]:  # bound to verl's Worker
    return release_caches_here()


def _parker_here(action: str) -> dict[str, Any]:
    """This process's parker does ``action`` (``reserve``, ``park``, ``unpark``); its report, with the host."""
    from timeslice_verl.ranks.park import parker

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
            PARK_RESERVE: _worker_park_reserve, **POLICY_METHODS}


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


def whoami(_actor: Any = None) -> tuple[str, int, str]:
    """(host, pid, Ray node id) of this rank (run in each worker through ``__ray_call__``)."""
    return socket.gethostname(), os.getpid(), node_id()


def node_id() -> str:
    """The Ray node this process runs on ("" outside Ray): what tells nodes apart where hostnames do not."""
    ray = sys.modules.get("ray")
    try:
        return str(ray.get_runtime_context().get_node_id()) if ray is not None and ray.is_initialized() else ""
    except Exception:  # an older Ray, or no worker context
        return ""
