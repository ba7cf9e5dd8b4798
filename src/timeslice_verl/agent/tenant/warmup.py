"""The tenant's warm-up: a freshly registered vLLM is put to sleep and woken while the GPU is its own anyway.

Why: a vLLM's first sleep after it started pins its host buffers, 1.85 s on the H200 against 0.13–0.16 s for every
later one (2026-12-01, ``benchmarks/results/2026-12-01-h200-valleys-round5/``). Left to the trainer, that one-off
falls on its first acquire, and it is the yield the trainer's first estimate of the round trip starts from: too dear
to lend the first valleys. The tenant's footprint is unknown until it first sleeps, too, so ``swap=auto`` could not
choose ``resident`` at the first release. The warm-up pays the one-off before any trainer needs the GPU; its last
cycle is the yield, wake and footprint that the estimate starts from.

Polite only: never down the reclaim ladder (nobody waits for the GPU), and given up the moment a trainer asks (the
tenant is then asleep, or it yields the usual way).
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
    """Pause and sleep the tenant with no ladder (nobody waits for the GPU); False when it did not."""
    tenant, deadline = tenancy.tenant, tenancy.reclaim_deadline_s
    assert tenant is not None
    start, free_before = time.time(), probe_free() if probe_free else 0
    try:
        seconds = await asyncio.wait_for(tenant.yield_gpu(), deadline or None)
    except asyncio.TimeoutError:  # a sleep that lands late is seen by the probe, and woken
        tenancy.journal.record("tenant_yield", tenant.name, start, False, detail=f"{label}: not asleep within {deadline:g} s")
        log.warning("tenant %s: %s given up: not asleep within %g s", tenant.name, label, deadline)
        return False
    except TenantError as exc:
        tenancy.fail("tenant_yield", start, exc)
        return False
    detail = tenancy.slept(start, free_before, probe_free, f"{label}: pause+sleep in {seconds:.3f} s", {"polite": seconds})
    log.info("tenant %s: %s", tenant.name, detail)
    tenancy.persist()
    return True


__all__ = ["WARM_UP_CYCLES", "warm_up", "yield_politely"]
