"""Fallback backend: NVIDIA's ``cuda-checkpoint`` binary, one subprocess per primitive.

No shell is involved: the binary path comes from the config and the only other argument is an
integer PID. Slower than the driver API (a process start per call) but independent of Python
bindings, and handy where the binary is what the site already trusts.
"""

from __future__ import annotations

import shutil
import subprocess

from timeslice_verl.agent.freeze.base import BackendUnavailable, ProcState

_STATES = {s.value: s for s in ProcState}


class CudaCliPrimitives:
    name = "cuda-cli"
    checkpoints_cuda = True
    frees_gpu_memory = True
    description = "cuda-checkpoint binary (fallback)"

    def __init__(self, binary: str = "cuda-checkpoint", call_timeout_s: float = 600.0) -> None:
        path = shutil.which(binary)
        if path is None:
            raise BackendUnavailable(f"timeslice.agent.cuda_checkpoint_bin: {binary!r} not found on PATH")
        self.binary = path
        self.call_timeout_s = call_timeout_s

    def _run(self, *args: str) -> str:
        proc = subprocess.run(
            [self.binary, *args], capture_output=True, text=True, timeout=self.call_timeout_s, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"cuda-checkpoint {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
        return proc.stdout

    def lock(self, pid: int, timeout_s: float) -> None:
        self._run("--action", "lock", "--pid", str(int(pid)), "--timeout", str(int(timeout_s * 1000)))

    def checkpoint(self, pid: int) -> None:
        self._run("--action", "checkpoint", "--pid", str(int(pid)))

    def restore(self, pid: int) -> None:
        self._run("--action", "restore", "--pid", str(int(pid)))

    def unlock(self, pid: int) -> None:
        self._run("--action", "unlock", "--pid", str(int(pid)))

    def state(self, pid: int) -> ProcState:
        out = self._run("--get-state", "--pid", str(int(pid))).strip().lower()
        return _STATES.get(out, ProcState.FAILED)
