"""NVML view of the agent's GPUs: which processes use them, how much memory is used and free.

Used to find a job's GPU processes (compute processes that carry its tag), to check there is room
before a restore (a restore that runs out of memory leaves the process stuck), and to verify that a
checkpoint really emptied the GPU and a restore really filled it again. Without NVML (a CPU-only
machine) :func:`open_probe` returns None and those checks are skipped, which the agent logs.
"""

from __future__ import annotations

import threading
from typing import Any
from dataclasses import dataclass

from timeslice_verl.log import get_logger

log = get_logger("agent.gpu")


@dataclass(frozen=True)
class GpuMemory:
    total: int
    used: int
    free: int


class NvmlProbe:
    def __init__(self, indices: list[int]) -> None:
        import pynvml

        self._nvml = pynvml
        self._lock = threading.Lock()
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        bad = [i for i in indices if i >= count]
        if bad:
            raise ValueError(f"timeslice.agent.gpus: GPU index {bad[0]} does not exist (NVML sees {count} GPU(s))")
        self.indices = list(indices)
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        driver = pynvml.nvmlSystemGetDriverVersion()
        self.driver_version = driver.decode() if isinstance(driver, bytes) else str(driver)

    def memory(self) -> GpuMemory:
        with self._lock:
            infos = [self._nvml.nvmlDeviceGetMemoryInfo(h) for h in self._handles]
        return GpuMemory(
            total=sum(int(i.total) for i in infos), used=sum(int(i.used) for i in infos), free=sum(int(i.free) for i in infos)
        )

    def uuids(self) -> list[str]:
        """The GPUs' NVML UUIDs (what names a GPU whatever CUDA_VISIBLE_DEVICES says)."""
        with self._lock:
            out = [self._nvml.nvmlDeviceGetUUID(h) for h in self._handles]
        return [u.decode() if isinstance(u, bytes) else str(u) for u in out]

    def largest_gpu(self) -> int:
        """The memory of the largest of the agent's GPUs: what one rank's figures can never exceed."""
        with self._lock:
            return max(int(self._nvml.nvmlDeviceGetMemoryInfo(h).total) for h in self._handles)

    def process_memory(self) -> dict[int, int]:
        """Bytes used per compute process on the agent's GPUs (summed over GPUs)."""
        out: dict[int, int] = {}
        with self._lock:
            for handle in self._handles:
                for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = proc.usedGpuMemory if isinstance(proc.usedGpuMemory, int) else 0
                    out[int(proc.pid)] = out.get(int(proc.pid), 0) + int(used or 0)
        return out

    def gpus_of(self, pids: list[int]) -> list[int]:
        """The agent's GPU indices on which any of ``pids`` runs a compute context."""
        wanted, out = set(pids), []
        with self._lock:
            for index, handle in zip(self.indices, self._handles):
                if any(int(p.pid) in wanted for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)):
                    out.append(index)
        return out

    def used_by(self, pids: list[int]) -> int:
        usage = self.process_memory()
        return sum(usage.get(p, 0) for p in pids)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # pragma: no cover
            pass


def nvml() -> tuple[Any | None, str]:
    """The initialised ``pynvml`` module, or None and why not (no driver, no GPU, not installed)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, ""
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError…
        return None, f"{type(exc).__name__}: {exc}"


def gpu_count() -> int:
    lib, _ = nvml()
    return int(lib.nvmlDeviceGetCount()) if lib is not None else 0


def process_bytes(pid: int) -> int | None:
    """GPU bytes NVML reports for ``pid`` over every GPU, or None without NVML."""
    lib, _ = nvml()
    if lib is None:
        return None
    total = 0
    for i in range(lib.nvmlDeviceGetCount()):
        for proc in lib.nvmlDeviceGetComputeRunningProcesses(lib.nvmlDeviceGetHandleByIndex(i)):
            if int(proc.pid) == pid and isinstance(proc.usedGpuMemory, int):
                total += proc.usedGpuMemory
    return total


def node_gpus() -> list[int]:
    """Every GPU index NVML sees on this node (``timeslice.agent.gpus=[]``); ValueError naming why when none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError…
        raise ValueError(f"timeslice.agent.gpus=[] means every GPU of the node, but NVML is unavailable ({exc}): "
                         "name the GPU indices") from None
    if not count:
        raise ValueError("timeslice.agent.gpus=[] means every GPU of the node, but NVML sees none")
    return list(range(count))


def open_probe(indices: list[int]) -> NvmlProbe | None:
    """An NVML probe of ``indices``, or None where NVML is unavailable (no driver, no GPU)."""
    try:
        return NvmlProbe(indices)
    except ValueError:
        raise
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError…
        log.info("NVML unavailable (%s): GPU memory checks are off", exc)
        return None
