"""A stand-in trainer GPU worker: holds memory on the device and does "training" work on command.

Started by the demo (and the GPU tests) with ``TIMESLICE_JOB`` in its environment, like verl's
worker processes, so the agent finds and freezes it. Line protocol on stdin/stdout:
``step <ms>`` → works for about that long, answers ``done <ms>``; ``check`` → ``checksum <value>``
(the data must survive checkpoint/restore and park/unpark unchanged); ``reserve``, ``park``, ``unpark``
→ what :mod:`timeslice_verl.ranks.park` did, ``caches`` → the bytes freed before a freeze (one JSON line each,
``{"error": …}`` when it failed: verl's worker-group methods, over a pipe); ``quit``. It prints
``ready <bytes> <checksum> <device>`` once its memory is allocated.

GPU mode (``--device cuda``, needs torch) allocates ``--gib`` GiB of random bf16 data plus a
matmul workspace; CPU mode (the dry run) holds a bytearray and spins.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time


class CpuWorker:
    device = "cpu"

    def __init__(self, mib: int) -> None:
        self.data = bytearray(os.urandom(1024)) * (mib * 1024)
        self.nbytes = len(self.data)

    def checksum(self) -> str:
        return hashlib.sha256(self.data).hexdigest()[:16]

    def step(self, ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        x = 0
        while time.perf_counter() < end:
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


class CudaWorker:
    device = "cuda"

    def __init__(self, gib: float) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(1234)
        n = int(gib * 2**30) // 2
        self.data = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        self.nbytes = self.data.numel() * 2 + self.a.numel() * 4

    def checksum(self) -> str:
        # chunked, so the check itself does not grow the allocator cache (it would be frozen too)
        words = self.data.view(self.torch.int16)
        total = 0
        for chunk in words.split(1 << 26):
            total += int(chunk.to(self.torch.int64).sum().item())
        self.torch.cuda.empty_cache()
        return f"{total:x}"

    def step(self, ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            for _ in range(8):
                self.a = (self.a @ self.b).clamp_(-1, 1)
            self.torch.cuda.synchronize()


def _swap_command(action: str) -> dict:
    """What verl's workers do for a handoff (``timeslice_park`` and friends), in this process."""
    from timeslice_verl.ranks.worker import release_caches_here
    from timeslice_verl.ranks.park import parker

    try:
        if action == "caches":
            return release_caches_here()
        return getattr(parker(), action)().to_dict()
    except Exception as exc:  # the driver decides (a failed park keeps the GPU for the valley)
        return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="timeslice-verl demo trainer worker")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gib", type=float, default=8.0, help="GPU memory to hold (cuda)")
    ap.add_argument("--mib", type=int, default=64, help="host memory to hold (cpu)")
    a = ap.parse_args(argv)
    worker = CudaWorker(a.gib) if a.device == "cuda" else CpuWorker(a.mib)
    print(f"ready {worker.nbytes} {worker.checksum()} {worker.device}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "step":
            t0 = time.perf_counter()
            worker.step(float(cmd[1]))
            print(f"done {(time.perf_counter() - t0) * 1e3:.1f}", flush=True)
        elif cmd[0] == "check":
            print(f"checksum {worker.checksum()}", flush=True)
        elif cmd[0] in ("reserve", "park", "unpark", "caches"):
            print(json.dumps(_swap_command(cmd[0])), flush=True)
        elif cmd[0] == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
