"""The tenant's warm-up: a freshly registered vLLM is put to sleep and woken while the GPU is its own anyway.

Why: a vLLM's first sleep after it started pins its host buffers, which makes it many times as long as every later
one. Left to the trainer, that one-off falls on its first acquire, and it is the yield the trainer's first estimate of the round trip starts from: too dear
to lend the first valleys. The tenant's footprint is unknown until it first sleeps, too, so ``swap=auto`` could not
choose ``resident`` at the first release. The warm-up pays the one-off before any trainer needs the GPU; its last
cycle is the yield, wake and footprint that the estimate starts from.

Polite only: never down the reclaim ladder (nobody waits for the GPU). A sleep under way when a trainer asks has
``reclaim_deadline_s`` from then to land (the tenant is then asleep, which is what the trainer needs) or the warm-up
is given up and the tenant yields the usual way; no cycle starts once one asks.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

from timeslice_verl.agent.tenant.vllm import AWAKE, TenantError
from timeslice_verl.log import get_logger

if TYPE_CHECKING:
    from timeslice_verl.agent.tenant.tenancy import Tenancy

log = get_logger("agent")

WARM_UP_CYCLES = 2
"""Sleeps and wakes of a warm-up: the first pays the one-off, the second is the tenant's measured yield and wake."""


async def warm_up(tenancy: Tenancy, probe_free: Callable[[], int] | None) -> int:
    """Put the registered, awake tenant through :data:`WARM_UP_CYCLES` sleeps and wakes; the cycles completed."""
    tenancy.warm_up_due, tenancy.warming = False, True  # one try per registration, whatever happens below
    done = 0
    try:
        for cycle in range(1, WARM_UP_CYCLES + 1):
            if tenancy.trainer_waiting() or tenancy.state != AWAKE:
                break
            if not await yield_politely(tenancy, probe_free, f"warm-up {cycle}/{WARM_UP_CYCLES}"):
                break
            if tenancy.trainer_waiting():
                break  # asleep, which is what the trainer needs
            await tenancy.reclaim(check_memory=probe_free is not None)
            done += 1
    finally:
        tenancy.warming = False
    return done


async def yield_politely(tenancy: Tenancy, probe_free: Callable[[], int] | None, label: str) -> bool:
    """Pause and sleep the tenant with no ladder (nobody waits for the GPU); False when it did not.

    Unbounded while no trainer waits, each control request having its own timeout: a large vLLM's first sleep pins
    gigabytes of host buffers over many seconds, and a warm-up given up there would leave that one-off to the trainer's
    first hold. Once a trainer asks, ``reclaim_deadline_s`` counts from then, as for any yield."""
    tenant = tenancy.tenant
    assert tenant is not None
    start, free_before = time.time(), probe_free() if probe_free else 0
    try:
        seconds = await until_asked(asyncio.ensure_future(tenant.yield_gpu()), tenancy.trainer_waiting,
                                    tenancy.reclaim_deadline_s)
    except asyncio.TimeoutError:  # a sleep that lands late is seen by the probe, and woken
        why = f"{label}: not asleep within {tenancy.reclaim_deadline_s:g} s of job {tenancy.trainer_waiting()!r} asking"
        tenancy.journal.record("tenant_yield", tenant.name, start, False, detail=why)
        log.warning("tenant %s: %s given up: %s", tenant.name, label, why)
        return False
    except TenantError as exc:
        tenancy.fail("tenant_yield", start, exc)
        return False
    detail = tenancy.slept(start, free_before, probe_free, f"{label}: pause+sleep in {seconds:.3f} s", {"polite": seconds})
    log.info("tenant %s: %s", tenant.name, detail)
    tenancy.persist()
    return True


ASK_POLL_S = 0.05
"""How often a polite yield looks whether a trainer has asked (the queue is the arbiter's; nothing signals it here)."""


async def until_asked(work: asyncio.Future[float], asked: Callable[[], object], deadline_s: float) -> float:
    """``work``'s result: no bound while ``asked()`` is falsy, then ``deadline_s`` (0: none) from the first time it is
    not; past that ``work`` is cancelled and :class:`asyncio.TimeoutError` raised."""
    loop, since = asyncio.get_running_loop(), None
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=ASK_POLL_S)
            if done:
                return work.result()
            if since is None and asked():
                since = loop.time()
            if since is not None and deadline_s and loop.time() - since >= deadline_s:
                raise asyncio.TimeoutError
    finally:
        if not work.done():
            work.cancel()


__all__ = ["ASK_POLL_S", "WARM_UP_CYCLES", "until_asked", "warm_up", "yield_politely"]
