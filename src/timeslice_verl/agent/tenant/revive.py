"""Between moves, as the watchdog asks: a dead or faulted tenant that answers again is registered again; a tenant
group's servers left out are brought back. Both under the step lock like any move, and both give way to a trainer
that asks meanwhile."""

from __future__ import annotations

import asyncio
from typing import Callable

from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.tenant.group import TenantGroup
from timeslice_verl.agent.tenant.tenancy import ReclaimAbandoned, Tenancy
from timeslice_verl.agent.tenant.vllm import AWAKE, DEAD, TenantError
from timeslice_verl.log import get_logger

log = get_logger("agent")


async def reregister(tenancy: Tenancy) -> bool:
    """A dead or faulted tenant that answers again is registered again, under the step lock like any move."""
    tenant = tenancy.tenant
    if tenant is None or not await tenant.alive():
        return False
    async with tenancy.lock, tenancy.step_lock:
        if tenancy.tenant is not tenant or tenancy.record is None:
            return False
        try:  # a trainer that asks meanwhile never waits on a tenant that answers slowly
            info = await tenancy.unless_a_trainer_asks(tenant.register())
        except ReclaimAbandoned:
            return False
        except TenantError as exc:
            tenancy.record.error = str(exc)
            return False
        tenancy.record.state, tenancy.record.version, tenancy.record.error = tenant.state, info.version, tenant.note
        tenancy._registered()
    log.info("tenant %s answers again (%s)", tenant.name, tenant.state)
    return True


async def revive_members(tenancy: Tenancy, current: Callable[[str], None]) -> bool:
    """A tenant group with servers left out: bring back those that answer again (never mid-move)."""
    group = tenancy.tenant
    if not isinstance(group, TenantGroup) or not group.dead or tenancy.record is None or tenancy.record.state in (DEAD, TENANT_FAULTED):
        return False
    async with tenancy.step_lock:
        await tenancy.behind.settled()
        current("tenant revive")
        revive = group.revive()
        try:
            if group.state == AWAKE:  # waking a server back never delays a trainer that asks meanwhile
                back = await tenancy.unless_a_trainer_asks(revive)
            else:  # the trainer holds the GPUs: putting a restarted server to sleep protects it
                back = await asyncio.wait_for(revive, tenancy.reclaim_deadline_s or None)
        except (ReclaimAbandoned, asyncio.TimeoutError):  # a half-woken server answers the next yield
            back = []
        finally:
            current("")
    tenancy.record.error = group.note
    return bool(back)


__all__ = ["reregister", "revive_members"]
