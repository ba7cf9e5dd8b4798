"""Freeze backends: freeze and thaw a job's GPU processes.

The arbiter sees only :class:`~timeslice_verl.agent.freeze.base.FreezeBackend` — *freeze a job's
GPU state, thaw it* — so a cooperative backend (the job's own processes parking their memory in
pinned host buffers through a control channel) can join the driver-API and CLI ones without
touching the arbiter. :func:`make_backend` builds one by name (``timeslice.agent.backend``).
"""

from __future__ import annotations

from timeslice_verl.agent.gpu import NvmlProbe
from timeslice_verl.agent.freeze.base import (
    BackendUnavailable,
    FreezeError,
    FreezeReport,
    ProcState,
    ThawError,
    ThawReport,
    FreezeBackend,
)

__all__ = [
    "BackendUnavailable",
    "FreezeError",
    "FreezeReport",
    "ProcState",
    "ThawError",
    "ThawReport",
    "FreezeBackend",
    "make_backend",
]


def make_backend(name: str, *, probe: NvmlProbe | None, driver_timeout_s: float, cuda_checkpoint_bin: str = "cuda-checkpoint") -> FreezeBackend:
    """``cuda`` (driver API), ``cuda-cli`` (the cuda-checkpoint binary) or ``sigstop`` (CPU test backend)."""
    if name == "cuda":
        from timeslice_verl.agent.freeze.cuda_driver import CudaDriverPrimitives

        return FreezeBackend(CudaDriverPrimitives(), probe=probe, driver_timeout_s=driver_timeout_s)
    if name == "cuda-cli":
        from timeslice_verl.agent.freeze.cuda_cli import CudaCliPrimitives

        return FreezeBackend(CudaCliPrimitives(cuda_checkpoint_bin), probe=probe, driver_timeout_s=driver_timeout_s)
    if name == "sigstop":
        from timeslice_verl.agent.freeze.sigstop import SigstopPrimitives

        return FreezeBackend(SigstopPrimitives(), probe=probe, driver_timeout_s=driver_timeout_s)
    raise ValueError(f"timeslice.agent.backend: unknown backend {name!r} (cuda, cuda-cli, sigstop)")
