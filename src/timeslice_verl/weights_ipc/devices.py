"""Which physical GPU a process holds, and the refusal when a sender and a receiver do not share one.

CUDA IPC opens another process's allocation only on the very GPU it lives on. Indices cannot tell: under
``CUDA_VISIBLE_DEVICES=0,0`` (or two different masks) two processes may both say "device 0" of different GPUs, or
different indices of the same one. The UUID can, so the comparison is on UUIDs (and hosts), in a pure function
(:func:`check_same_device`); only :func:`local_device` touches torch, lazily.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from timeslice_verl.weights import WeightsError


class DeviceMismatch(WeightsError):
    """A receiver is not on the sender's GPU: the message names both devices (UUID, index, mask, host, pid)."""


def normalize_uuid(raw: Any) -> str:
    """One spelling for a GPU's UUID, whoever reported it: NVML's ``GPU-6f0e…`` and torch's ``6f0e…`` (upper or
    lower case) give ``GPU-6f0e…``; a MIG instance keeps its ``MIG-`` prefix. Empty or blank: ``""`` (unknown)."""
    text = str(raw or "").strip().lower()
    if not text:
        return ""
    if text.startswith("mig-"):
        return "MIG-" + text[4:]
    if text.startswith("gpu-"):
        text = text[4:]
    return "GPU-" + text


@dataclass(frozen=True)
class DeviceIdentity:
    """One process's CUDA device, as that process sees it and as the driver names it."""

    uuid: str
    """Normalized (:func:`normalize_uuid`); ``""``: unknown."""
    index: int
    """The torch device index inside that process."""
    visible: str
    """That process's ``CUDA_VISIBLE_DEVICES`` (``""``: unset)."""
    host: str
    pid: int

    def describe(self) -> str:
        mask = self.visible if self.visible else "unset"
        return (f"GPU {self.uuid or '<unknown uuid>'} (cuda:{self.index}, CUDA_VISIBLE_DEVICES={mask}) "
                f"on host {self.host}, pid {self.pid}")


def same_device(a: DeviceIdentity, b: DeviceIdentity) -> bool:
    """The same physical GPU: equal known UUIDs on the same host (indices and masks do not count)."""
    ua, ub = normalize_uuid(a.uuid), normalize_uuid(b.uuid)
    return bool(ua) and ua == ub and a.host == b.host


def check_same_device(sender: DeviceIdentity, receiver: DeviceIdentity) -> None:
    """Raise :class:`DeviceMismatch` naming both devices unless they are one physical GPU."""
    if same_device(sender, receiver):
        return
    if not normalize_uuid(sender.uuid) or not normalize_uuid(receiver.uuid):
        why = "a device's UUID is unknown, so sharing one GPU cannot be proven"
    elif sender.host != receiver.host:
        why = "they are on different hosts"
    else:
        why = "they are different GPUs (compared by UUID, not by index)"
    raise DeviceMismatch(
        f"same-GPU CUDA IPC weight transfer refused: sender {sender.describe()} and receiver "
        f"{receiver.describe()}: {why}. The timeslice_ipc checkpoint engine serves a trainer and a rollout on ONE "
        "GPU (Ray started with CUDA_VISIBLE_DEVICES=N,N and num_gpus=2); use verl's nccl backend across GPUs"
    )


def local_device(index: int | None = None) -> DeviceIdentity:
    """This process's current CUDA device (or ``index``), UUID from torch's device properties."""
    import torch

    idx = torch.cuda.current_device() if index is None else index
    uuid = normalize_uuid(getattr(torch.cuda.get_device_properties(idx), "uuid", ""))
    return DeviceIdentity(uuid=uuid, index=idx, visible=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                          host=socket.gethostname(), pid=os.getpid())


__all__ = ["DeviceIdentity", "DeviceMismatch", "check_same_device", "local_device", "normalize_uuid", "same_device"]
