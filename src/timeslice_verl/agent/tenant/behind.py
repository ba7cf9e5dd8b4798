"""A pause-only yield that the trainer need not wait out: the grant follows after ``tenant.pause_grant_s`` at most.

Where the trainer's measured peak fits beside the awake tenant (:mod:`~timeslice_verl.agent.tenant.hold`), the yield
moves no memory: it only stops vLLM's scheduler. vLLM's engine stops within one step of receiving ``/pause``, but a
busy API server (hundreds of short requests a second, their outputs to detokenize) answers the request up to a few
tenths of a second later, several times what the same request takes idle. Waiting for that
answer is what made the trainer's first, unforecast valley its longest wait. So the trainer is granted the GPU
after ``pause_grant_s`` even if the answer has not come: at worst its first kernels share the GPU with the tenant's
last engine step. The yield runs on behind the grant — down the ladder if it must, which then frees the GPU as
always — and every later move on the tenant (reclaim, sleep, registration) waits for it to settle first.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from timeslice_verl.log import get_logger

log = get_logger("agent")


class Behind:
    """The one pause-only yield that may still be running after its grant."""

    def __init__(self) -> None:
        self.task: asyncio.Future[Any] | None = None

    @property
    def pending(self) -> bool:
        """A yield was started and has not finished: the tenant counts as held (paused, its memory on the GPU)."""
        return self.task is not None and not self.task.done()

    async def start(self, move: Awaitable[Any], grant_after_s: float, settled: Callable[[], None]) -> bool:
        """Run ``move`` (the yield); return once it ended or ``grant_after_s`` passed, whichever first. True when it
        runs on behind the grant; ``settled`` is called when it ends (the reconciler re-reads the tenant)."""
        task = asyncio.ensure_future(move)
        done, _ = await asyncio.wait({task}, timeout=max(0.0, grant_after_s))
        if task in done:
            task.result()
            return False
        self.task = task

        def ended(t: asyncio.Future[Any]) -> None:
            if not t.cancelled() and t.exception() is not None:  # the yield's own failures are handled inside it
                log.error("tenant yield behind the grant failed: %r", t.exception())
            settled()

        task.add_done_callback(ended)
        return True

    async def settled(self) -> None:
        """Wait for a yield still running behind a grant (its outcome is the tenant's recorded state)."""
        task = self.task
        if task is not None and not task.done():
            await asyncio.wait({task})
        self.task = None


__all__ = ["Behind"]
