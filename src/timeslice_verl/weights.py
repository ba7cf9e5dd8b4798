"""A trainer's weights as vLLM's weight-transfer API takes them: ``update_info`` bodies of CUDA IPC handles.

Base layer (torch lazily): the validation's policy tenant pushes them, and a verl rank builds them for its own GPU
(:mod:`~timeslice_verl.ranks.policy`). The tenant on the same GPU opens each handle: no copy through the host. The
tensors must stay alive until the push returns (vLLM copies them into its own parameters during
``/update_weights``), and a park must not move them meanwhile.
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from typing import Any, Iterable, Iterator


class WeightsError(Exception):
    """Weights that cannot be sent as asked; the message names the tensor and why."""


@dataclass(frozen=True)
class Update:
    """One ``/update_weights`` body (``info``: vLLM's ``update_info``, nothing else in it) and the bytes it moves."""

    info: dict[str, Any]
    bytes: int = 0


def ipc_updates(named: Iterable[tuple[str, Any]], *, chunk_bytes: int = 1 << 30) -> Iterator[Update]:
    """``update_info`` bodies of CUDA IPC handles for named CUDA tensors, about ``chunk_bytes`` of tensors each (the
    tenant opens each handle on its side of the same GPU). The caller keeps the tensors alive until the push
    returns; a non-contiguous tensor's contiguous copy is kept here until its chunk was sent."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    handles: list[dict[str, tuple]] = []
    keep: list[Any] = []
    size = 0
    for name, tensor in named:
        if not tensor.is_cuda:
            raise WeightsError(f"tensor {name!r} is on {tensor.device}: IPC handles are for CUDA tensors")
        weight = tensor.detach().contiguous()
        keep.append(weight)
        uuid = str(torch.cuda.get_device_properties(weight.device).uuid)
        names.append(name)
        dtypes.append(str(weight.dtype).split(".")[-1])
        shapes.append(list(weight.shape))
        handles.append({uuid: reduce_tensor(weight)[1]})
        size += weight.numel() * weight.element_size()
        if size >= chunk_bytes:
            yield _update_info(names, dtypes, shapes, handles, size)
            names, dtypes, shapes, handles, keep, size = [], [], [], [], [], 0
    if names:
        yield _update_info(names, dtypes, shapes, handles, size)


def _update_info(names: list[str], dtypes: list[str], shapes: list[list[int]], handles: list[dict[str, tuple]],
                 size: int) -> Update:
    return Update({"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": False,
                   "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}, size)


__all__ = ["Update", "WeightsError", "ipc_updates"]
