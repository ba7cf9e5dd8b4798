"""CPU test backend: SIGSTOP/SIGCONT. For CI and dry runs only — it frees no GPU memory.

It stands in for the checkpoint primitives so the agent's sequencing, arbitration, unwinding and
crash handling run for real on machines without a GPU: ``checkpoint`` stops the process,
``restore`` continues it, ``lock``/``unlock`` do nothing. The agent announces it as a test backend.
"""

from __future__ import annotations

import os
import signal
import time

from timeslice_verl.agent import procfs
from timeslice_verl.agent.freeze.base import ProcState


class SigstopPrimitives:
    name = "sigstop"
    checkpoints_cuda = False
    frees_gpu_memory = False
    description = "CPU TEST BACKEND (SIGSTOP/SIGCONT): pauses processes, frees no GPU memory"

    def lock(self, pid: int, timeout_s: float) -> None:
        if procfs.state_char(pid) is None:
            raise ProcessLookupError(f"pid {pid} is gone")

    def unlock(self, pid: int) -> None:
        if procfs.state_char(pid) is None:
            raise ProcessLookupError(f"pid {pid} is gone")

    def checkpoint(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self._wait(pid, stopped=True)

    def restore(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        self._wait(pid, stopped=False)

    def state(self, pid: int) -> ProcState:
        char = procfs.state_char(pid)
        if char is None or char in ("Z", "X"):
            return ProcState.GONE
        return ProcState.CHECKPOINTED if char in ("T", "t") else ProcState.RUNNING

    @staticmethod
    def _wait(pid: int, *, stopped: bool, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            char = procfs.state_char(pid)
            if char is None:
                raise ProcessLookupError(f"pid {pid} is gone")
            if (char in ("T", "t")) == stopped:
                return
            time.sleep(0.002)
        raise TimeoutError(f"pid {pid} did not {'stop' if stopped else 'continue'} within {timeout_s} s")
