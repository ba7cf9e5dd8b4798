"""What verl's checkpoint engine moved in one weight sync, for the end of the sync to say.

verl's ``CheckpointEngineManager.update_weights`` returns the sending engine's metrics (``timeslice_ipc`` reports
bytes and seconds) and fully-async verl drops them; for the sync's duration the adapter wraps the trainer's manager
on the instance, keeps what it returns, and unwraps it. Nothing here imports verl or torch.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

from timeslice_verl.weights_ipc import METRIC_BYTES, METRIC_SECONDS


@dataclass(frozen=True)
class Transfer:
    """Bytes the engine pushed and the seconds from its first tensor to the receivers' last acknowledgement."""

    pushed_bytes: int
    push_s: float


def transfer_of(metrics: Any) -> Transfer | None:
    """The engine's bytes and seconds from verl's sync metrics; None when the engine reports neither."""
    if not isinstance(metrics, dict):
        return None
    nbytes, seconds = metrics.get(METRIC_BYTES), metrics.get(METRIC_SECONDS)
    if not isinstance(nbytes, (int, float)) or not isinstance(seconds, (int, float)):
        return None
    return Transfer(int(nbytes), round(float(seconds), 6))


@contextlib.contextmanager
def captured_transfer(trainer: Any) -> Iterator[list[Transfer]]:
    """While open, every ``trainer.checkpoint_manager.update_weights`` result the engine reported lands in the
    yielded list. A trainer without a manager (or one already wrapped) yields an empty list and is left alone."""
    seen: list[Transfer] = []
    manager = getattr(trainer, "checkpoint_manager", None)
    original = getattr(manager, "update_weights", None)
    if original is None or "update_weights" in getattr(manager, "__dict__", {"update_weights": None}):
        yield seen
        return

    async def update_weights(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        transfer = transfer_of(result)
        if transfer is not None:
            seen.append(transfer)
        return result

    manager.update_weights = update_weights
    try:
        yield seen
    finally:
        manager.__dict__.pop("update_weights", None)


__all__ = ["Transfer", "captured_transfer", "transfer_of"]
