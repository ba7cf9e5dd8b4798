"""Two real processes on one GPU pushing weights through :mod:`.transport`: bit-exactness, speed, memory.

The calling process is the trainer (sender); a spawned child is the rollout (receiver), which copies every tensor
into weights of its own, as vLLM does. Per update: a fresh sender listens, the child connects, the push runs, both
close, and both report ``torch.cuda.memory_allocated`` and (NVML) each process's used memory. Needs torch only
(``pynvml`` optional); used by ``benchmarks/ipc_push.py`` and the GPU tests.
"""

from __future__ import annotations

import hashlib
import multiprocessing.connection
import os
import time
from dataclasses import dataclass, field
from typing import Any

from timeslice_verl.weights_ipc.transport import Receiver, Sender

MIB = 1 << 20
REPLY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str
    shape: tuple[int, ...]


def weight_specs(total_bytes: int, bucket_bytes: int) -> list[Spec]:
    """A model-like mix of about ``total_bytes``: bf16 matrices, fp32 norms, odd sizes, a 0-d and an empty tensor,
    and two tensors larger than a bucket (cut into chunks on the way)."""
    specs = [Spec("scalar", "float32", ()), Spec("empty", "bfloat16", (0, 8)), Spec("odd", "int64", (3, 7)),
             Spec("embed.weight", "bfloat16", (2, bucket_bytes // 2 + 4096)),
             Spec("lm_head.weight", "float32", (bucket_bytes // 4 + 1000,)),
             Spec("mask", "bool", (1001,))]
    used, layer = sum(_nbytes(s) for s in specs), 0
    while used < total_bytes:
        for part, rows in (("qkv", 3 * 1024), ("o", 1024), ("mlp", 2816)):
            spec = Spec(f"layers.{layer}.{part}.weight", "bfloat16", (rows, 1024 + 8 * (layer % 3)))
            specs.append(spec)
            used += _nbytes(spec)
        specs.append(Spec(f"layers.{layer}.norm.weight", "float32", (1024 + 8 * (layer % 3),)))
        used += _nbytes(specs[-1])
        layer += 1
    return specs


def _nbytes(spec: Spec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}[spec.dtype]


def make_weights(specs: list[Spec], device: int, seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    out = {}
    for s in specs:
        dtype = getattr(torch, s.dtype)
        if dtype.is_floating_point:
            out[s.name] = torch.randn(s.shape, dtype=dtype, device=f"cuda:{device}", generator=gen)
        else:
            out[s.name] = torch.randint(0, 2 if dtype == torch.bool else 1 << 30, s.shape, device=f"cuda:{device}",
                                        generator=gen).to(dtype)
    return out


def checksums(named: dict[str, Any]) -> dict[str, str]:
    """blake2b of each tensor's bytes (copied to the host): equal only when bit-exact."""
    import torch

    out = {}
    for name, t in named.items():
        raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
        out[name] = hashlib.blake2b(raw, digest_size=16).hexdigest()
    return out


def nvml_used(pids: list[int], device: int) -> dict[int, int | None]:
    """Each process's used GPU memory per NVML (None: NVML or the process not seen, e.g. another PID namespace)."""
    try:
        import pynvml
    except ImportError:
        return {p: None for p in pids}
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
        procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except pynvml.NVMLError:
        return {p: None for p in pids}
    return {p: procs.get(p) for p in pids}


def _nvml_index(device: int) -> int:
    visible = [e for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    return int(visible[device]) if visible and visible[device].strip().isdigit() else device


def _receiver_main(conn: Any, device: int, specs: list[Spec]) -> None:
    """The child: own copies of the weights, then one update per ``("push", address)`` until ``("stop",)``."""
    import torch

    torch.cuda.set_device(device)
    dst = {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=f"cuda:{device}") for s in specs}
    torch.cuda.synchronize()
    conn.send(("ready", os.getpid(), torch.cuda.memory_allocated(device)))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "checksums":
            conn.send(("checksums", checksums(dst)))
            continue
        receiver = Receiver(msg[1])
        t0 = time.perf_counter()
        receiver.connect()
        count = _consume(receiver, dst)
        clean = receiver.close()
        torch.cuda.synchronize()
        conn.send(("done", count, clean, time.perf_counter() - t0, torch.cuda.memory_allocated(device)))


def _consume(receiver: Receiver, dst: dict[str, Any]) -> int:
    count = 0
    for name, tensor in receiver.tensors():
        dst[name].copy_(tensor, non_blocking=True)
        count += 1
    return count  # the last view dies with this frame, before close()


@dataclass
class UpdateRecord:
    push_s: float
    update_s: float
    bytes: int
    tensors_received: int
    sender_clean: bool
    receiver_clean: bool
    sender_allocated: int
    receiver_allocated: int
    nvml: dict[int, int | None] = field(default_factory=dict)


class PushRig:
    """The sender's weights here, a receiver child on the same GPU; :meth:`update` runs one full update."""

    def __init__(self, total_bytes: int, bucket_bytes: int, *, device: int = 0, seed: int = 0) -> None:
        import torch
        import torch.multiprocessing as mp

        torch.cuda.set_device(device)
        self.device, self.bucket_bytes = device, bucket_bytes
        self.specs = weight_specs(total_bytes, bucket_bytes)
        self.weights = make_weights(self.specs, device, seed)
        self.bytes = sum(t.numel() * t.element_size() for t in self.weights.values())
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.child = ctx.Process(target=_receiver_main, args=(child, device, self.specs), daemon=True)
        self.child.start()
        _, self.child_pid, self.receiver_baseline = self._reply("ready")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.sender_baseline = torch.cuda.memory_allocated(device)
        self.nvml_baseline = nvml_used([os.getpid(), self.child_pid], device)

    def _reply(self, kind: str) -> tuple:
        if not self._conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"the receiver sent no {kind!r} within {REPLY_TIMEOUT_S:.0f} s "
                               f"(alive: {self.child.is_alive()}, exit code {self.child.exitcode})")
        msg = self._conn.recv()
        if msg[0] != kind:
            raise RuntimeError(f"the receiver answered {msg!r}, expected {kind!r}")
        return msg

    def update(self) -> UpdateRecord:
        import torch

        t0 = time.perf_counter()
        sender = Sender(self.bucket_bytes)
        address = sender.listen()
        self._conn.send(("push", address))
        sender.accept(1)
        stats = sender.push(self.weights.items())
        sender_clean = sender.close()
        _, count, receiver_clean, _, receiver_allocated = self._reply("done")
        update_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        return UpdateRecord(stats.seconds, update_s, stats.bytes, count, sender_clean, receiver_clean,
                            torch.cuda.memory_allocated(self.device), receiver_allocated,
                            nvml_used([os.getpid(), self.child_pid], self.device))

    def bit_exact(self) -> bool:
        self._conn.send(("checksums",))
        (_, theirs) = self._reply("checksums")
        return theirs == checksums(self.weights)

    def close(self) -> None:
        if self.child.is_alive():
            self._conn.send(("stop",))
            self.child.join(60)
        if self.child.is_alive():
            self.child.kill()


def copy_rate(nbytes: int, device: int = 0, repeats: int = 5) -> float:
    """This GPU's device-to-device ``copy_`` rate in bytes/s (bytes copied, not read + written), best of
    ``repeats``, measured with CUDA events."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best


__all__ = ["PushRig", "Spec", "UpdateRecord", "checksums", "copy_rate", "make_weights", "nvml_used", "weight_specs"]
