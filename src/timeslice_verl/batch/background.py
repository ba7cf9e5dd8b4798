"""Background tasks the event loop keeps: a task nobody references may be garbage-collected before it ends (asyncio
holds only a weak reference), so every fire-and-forget task of the batch package is started here and kept until done."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine

_KEPT: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
    """Start ``coro`` on the running loop and keep its task until it is done."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _KEPT.add(task)
    task.add_done_callback(_KEPT.discard)
    return task


def running() -> int:
    """How many are still kept (the tests' view)."""
    return len(_KEPT)


__all__ = ["running", "spawn"]
