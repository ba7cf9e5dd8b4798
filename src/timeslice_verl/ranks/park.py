"""Park/unpark: a trainer process moves its own GPU tensors to pinned host RAM and back, at copy-engine speed.

The driver checkpoint moves a whole process (context, NCCL, allocator pools) at ~2 GB/s; a park copies
only the tensors that hold state — parameters, gradients, optimizer state, any other tensor the
process keeps between steps — on a side stream into one persistent pinned host buffer (tens of GB/s
on a current GPU), then frees each storage with ``untyped_storage().resize_(0)`` and empties torch's cache.
Every tensor, view and parameter keeps its identity: unpark re-grows the same storages and copies
the bytes back, so optimizers, FSDP and hooks see nothing but new device addresses.

Pinning host memory is slow (~1.4 s per GB), so it happens once, in :meth:`Parker.reserve` (called
at ``init_workers_end``, sized for the optimizer state still to come); a park that needs more grows
the buffer and says so. Runs inside the trainer's worker processes: imports torch lazily, never at
import time, so the light core stays light.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

from timeslice_verl.log import get_logger

log = get_logger("park")

ALIGN = 4096
"""Host offsets are page-aligned: the copy engine is fastest on aligned spans."""
ADAM_STATE_TENSORS = 2
"""Adam-family optimizers keep two moment tensors per parameter, created at their first step."""


class ParkError(RuntimeError):
    """A park or unpark that could not happen; the tensors are left resident (never half-parked)."""


@dataclass
class ParkReport:
    """What one park or unpark did, for the agent (``pid``, ``parked``, ``kept``) and the figures."""

    pid: int
    action: str
    parked: int = 0
    """Bytes now in (park) or back from (unpark) the host buffer."""
    kept: int = 0
    """Bytes torch still reserves on the device after the park (what the agent expects to see)."""
    storages: int = 0
    seconds: float = 0.0
    copy_s: float = 0.0
    pin_s: float = 0.0
    """Seconds spent pinning host memory in this call (0 in steady state)."""
    pinned: int = 0
    """Size of the pinned host buffer."""
    copy_gbps: float = 0.0
    """``reserve``: this GPU's pinned copy rate, device to host and back (what a park round trip is estimated by)."""
    device: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _local(t: Any) -> Any:
    """The tensor that owns storage: a DTensor's local shard, else the tensor itself."""
    return getattr(t, "_local_tensor", t)


@dataclass
class _Slot:
    storage: Any
    nbytes: int
    chunk: int
    offset: int


@dataclass
class Parker:
    """Parks every tensor reachable from the process's modules and optimizers, plus tensors found loose.

    Roots (``torch.nn.Module`` and ``torch.optim.Optimizer`` instances) and loose tensors are found by
    one scan of the garbage collector's objects in :meth:`reserve` (repeated at the first park if
    none ran); each park then walks the roots, which is fast. Tensors created later outside any root
    stay on the device and show up in :attr:`ParkReport.kept`.
    """

    device: Any = None
    loose: bool = True
    """Also park device tensors outside modules and optimizers (found by the scan)."""
    chunks: list[Any] = field(default_factory=list)
    slots: list[_Slot] = field(default_factory=list)
    parked: bool = False
    _modules: list[Any] = field(default_factory=list)
    _optims: list[Any] = field(default_factory=list)
    _loose: list[Any] = field(default_factory=list)
    _scanned: bool = False

    # ------------------------------------------------------------------ discovery

    def scan(self) -> None:
        """Find the roots and the loose device tensors (weak references: parking keeps nothing alive)."""
        import torch

        modules, optims, loose = [], [], []
        loose_too = self.loose and self._device().type == "cuda"  # on a CPU every tensor of the process is "loose"
        with warnings.catch_warnings():  # isinstance on some modules' deprecated attributes warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.nn.Module):
                        modules.append(weakref.ref(obj))
                    elif isinstance(obj, torch.optim.Optimizer):
                        optims.append(weakref.ref(obj))
                    elif loose_too and isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
                        local = _local(obj)
                        if local.device.type == self._device().type and local.untyped_storage().nbytes():
                            loose.append(weakref.ref(obj))
                except (ReferenceError, RuntimeError, TypeError):  # exotic objects: not ours to park
                    continue
        self._modules, self._optims, self._loose = modules, optims, loose
        self._scanned = True

    def _device(self) -> Any:
        import torch

        if self.device is None:
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return torch.device(self.device)

    def tensors(self) -> list[Any]:
        """Every live tensor reachable from the roots, and the loose ones still alive."""
        out = []
        for ref in self._modules:
            module = ref()
            if module is None:
                continue
            for p in module.parameters(recurse=False):
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
            out.extend(b for b in module.buffers(recurse=False) if b is not None)
        for ref in self._optims:
            optim = ref()
            if optim is None:
                continue
            for state in optim.state.values():
                out.extend(v for v in state.values() if hasattr(v, "untyped_storage"))
        out.extend(t for t in (ref() for ref in self._loose) if t is not None)
        return out

    def storages(self) -> list[tuple[Any, int]]:
        """The distinct, resizable, non-empty device storages behind :meth:`tensors`, largest first (never a version kept
    for the policy tenant: its IPC handles must outlive the park)."""
        from timeslice_verl.ranks.policy import exported

        device = self._device()
        own = {c.untyped_storage().data_ptr() for c in self.chunks} | exported()  # a version vLLM holds handles to
        seen: dict[int, tuple[Any, int]] = {}
        for t in self.tensors():
            try:
                local = _local(t)
                if local.device != device and not (device.type == "cpu" and local.device.type == "cpu"):
                    continue
                storage = local.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a subclass without storage
                continue
            nbytes = storage.nbytes()
            if nbytes and storage.resizable() and storage.data_ptr() not in own:
                seen.setdefault(storage.data_ptr(), (storage, nbytes))
        return sorted(seen.values(), key=lambda s: -s[1])

    # ------------------------------------------------------------------ host buffer

    def capacity(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def _pin(self, nbytes: int) -> float:
        import torch

        t0 = time.perf_counter()
        pin = self._device().type == "cuda"
        self.chunks.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
        return time.perf_counter() - t0

    def estimate(self) -> int:
        """Bytes a park will need once training has run: today's storages, plus gradients not yet
        created, plus Adam-family optimizer state not yet created."""
        present = self.storages()
        total = sum(n for _, n in present) + ALIGN * len(present)
        for ref in self._modules:
            module = ref()
            if module is None:
                continue
            for p in module.parameters(recurse=False):
                if p.requires_grad and p.grad is None:
                    total += _local(p).untyped_storage().nbytes() + ALIGN
        for ref in self._optims:
            optim = ref()
            if optim is None or optim.state or "Adam" not in type(optim).__name__:
                continue
            for group in optim.param_groups:
                for p in group["params"]:
                    total += ADAM_STATE_TENSORS * (_local(p).untyped_storage().nbytes() + ALIGN) + ALIGN  # + step
        return total

    def reserve(self, nbytes: int | None = None) -> ParkReport:
        """Pin the host buffer now (slow, once): ``nbytes`` or :meth:`estimate`."""
        self.scan()
        want = self.estimate() if nbytes is None else nbytes
        report = ParkReport(pid=os.getpid(), action="reserve", device=str(self._device()))
        if want > self.capacity():
            report.pin_s = self._pin(want - self.capacity())
            log.info("park: pinned %.2f GiB of host memory in %.1f s", want / 2**30, report.pin_s)
        report.pinned = self.capacity()
        report.copy_gbps = self._copy_rate()
        return report

    def _copy_rate(self, nbytes: int = 256 * 2**20) -> float:
        """GB/s of one copy each way between the device and the pinned buffer (0 on a CPU or without a buffer)."""
        import torch

        if self._device().type != "cuda" or not self.chunks:
            return 0.0
        host = self.chunks[0][: min(nbytes, self.chunks[0].numel())]
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=self._device())
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        finally:
            del dev
            torch.cuda.empty_cache()
        return round(2 * host.numel() / 1e9 / seconds, 2) if seconds > 0 else 0.0

    def _layout(self, storages: list[tuple[Any, int]]) -> float:
        """Place each storage in the host buffer (first fit, page-aligned); grow the buffer if needed."""
        pin_s = 0.0
        for attempt in (1, 2):
            slots, free = [], [0] * len(self.chunks)
            missing = 0
            for storage, nbytes in storages:
                for i, chunk in enumerate(self.chunks):
                    if free[i] + nbytes <= chunk.numel():
                        slots.append(_Slot(storage, nbytes, i, free[i]))
                        free[i] = -(-(free[i] + nbytes) // ALIGN) * ALIGN
                        break
                else:
                    missing += nbytes + ALIGN
            if not missing:
                self.slots = slots
                return pin_s
            if attempt == 2:
                break
            largest = max(n for _, n in storages)
            grow = max(missing, largest + ALIGN)
            log.warning("park: the pinned host buffer is %.2f GiB short: pinning more now (one time, %s)",
                        grow / 2**30, "call reserve() at init to avoid it")
            pin_s += self._pin(grow)
        raise ParkError("park: could not lay out the tensors in the pinned host buffer")  # pragma: no cover

    # ------------------------------------------------------------------ park / unpark

    @staticmethod
    def _bytes_view(storage: Any) -> Any:
        import torch

        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))

    def park(self) -> ParkReport:
        """Copy every storage to the host buffer, then free it on the device. Idempotent."""
        import torch

        report = ParkReport(pid=os.getpid(), action="park", device=str(self._device()))
        if self.parked:
            report.pinned = self.capacity()
            return report
        t0 = time.perf_counter()
        if not self._scanned:
            self.scan()
        storages = self.storages()
        report.pin_s = self._layout(storages) if storages else 0.0
        cuda = self._device().type == "cuda"
        t1 = time.perf_counter()
        try:
            if cuda:
                side = torch.cuda.Stream(self._device())
                side.wait_stream(torch.cuda.current_stream(self._device()))
                with torch.cuda.stream(side):
                    for slot in self.slots:
                        self.chunks[slot.chunk][slot.offset:slot.offset + slot.nbytes].copy_(
                            self._bytes_view(slot.storage), non_blocking=True)
                side.synchronize()
            else:
                for slot in self.slots:
                    self.chunks[slot.chunk][slot.offset:slot.offset + slot.nbytes].copy_(self._bytes_view(slot.storage))
        except Exception as exc:  # nothing freed yet: the tensors are intact where they were
            self.slots = []
            raise ParkError(f"park: copying to host failed, nothing was freed: {exc}") from exc
        report.copy_s = time.perf_counter() - t1
        for slot in self.slots:
            slot.storage.resize_(0)
        self.parked = True
        if cuda:
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:  # cuBLAS keeps tens of MiB per stream in torch's allocator
                clear_workspaces()
            torch.cuda.empty_cache()
            report.kept = int(torch.cuda.memory_reserved(self._device()))
        report.parked = sum(s.nbytes for s in self.slots)
        report.storages = len(self.slots)
        report.pinned = self.capacity()
        report.seconds = time.perf_counter() - t0
        return report

    def unpark(self) -> ParkReport:
        """Re-grow every parked storage and copy its bytes back. Idempotent."""
        import torch

        report = ParkReport(pid=os.getpid(), action="unpark", device=str(self._device()))
        if not self.parked:
            return report
        t0 = time.perf_counter()
        cuda = self._device().type == "cuda"
        grown: list[_Slot] = []
        try:
            for slot in self.slots:
                slot.storage.resize_(slot.nbytes)
                grown.append(slot)
        except Exception as exc:  # out of device memory: give back what was grown, stay parked
            for slot in grown:
                slot.storage.resize_(0)
            if cuda:
                torch.cuda.empty_cache()
            raise ParkError(f"unpark: could not re-allocate {sum(s.nbytes for s in self.slots) / 2**30:.2f} GiB on "
                            f"{self._device()} ({exc}); the tensors stay parked in host memory") from exc
        t1 = time.perf_counter()
        if cuda:
            current = torch.cuda.current_stream(self._device())
            side = torch.cuda.Stream(self._device())
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for slot in self.slots:
                    self._bytes_view(slot.storage).copy_(self.chunks[slot.chunk][slot.offset:slot.offset + slot.nbytes],
                                                         non_blocking=True)
            side.synchronize()
        else:
            for slot in self.slots:
                self._bytes_view(slot.storage).copy_(self.chunks[slot.chunk][slot.offset:slot.offset + slot.nbytes])
        report.copy_s = time.perf_counter() - t1
        report.parked = sum(s.nbytes for s in self.slots)
        report.storages = len(self.slots)
        report.pinned = self.capacity()
        self.slots = []
        self.parked = False
        report.seconds = time.perf_counter() - t0
        return report


_PARKER: Parker | None = None


def parker() -> Parker:
    """This process's parker (one per process: it owns the pinned buffer)."""
    global _PARKER
    if _PARKER is None:
        _PARKER = Parker()
    return _PARKER


__all__ = ["ParkError", "ParkReport", "Parker", "parker"]
