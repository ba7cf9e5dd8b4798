"""How much memory the GPU a tenant is about to start on has free (NVML), named as ``CUDA_VISIBLE_DEVICES`` names it."""

from __future__ import annotations

import os

from timeslice_verl.log import get_logger

log = get_logger("tenant")


def free_and_total(gpu: str = "") -> tuple[int, int] | None:
    """(free, total) bytes of ``gpu`` (an index or a ``GPU-…`` UUID; empty: the first of ``CUDA_VISIBLE_DEVICES``,
    else 0); None without NVML."""
    name = gpu or (os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0")
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(name) if name.startswith(("GPU-", "MIG-")) else \
            pynvml.nvmlDeviceGetHandleByIndex(int(name))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    except Exception as exc:  # no driver, no such GPU: vLLM says the rest itself
        log.debug("tenant: the GPU's memory is unknown (%s)", exc)
        return None


__all__ = ["free_and_total"]
