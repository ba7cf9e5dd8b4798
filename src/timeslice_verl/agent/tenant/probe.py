"""The probe: while the tenant has the GPU, the watchdog asks each server the state it is in (through
:func:`probe`); one that does not answer twice in a row is *wedged*, one asleep or paused while recorded awake is
recorded asleep, one whose listener is gone is dead — so the state the agent reports is the tenant's."""

from __future__ import annotations

import asyncio
from typing import Any

from timeslice_verl.agent.tenant import proc as tenant_proc
from timeslice_verl.agent.tenant.tenancy import WEDGED_AFTER, Tenancy
from timeslice_verl.agent.tenant.vllm import ASLEEP, AWAKE, DEAD, TenantDead, VllmTenant
from timeslice_verl.agent.tenant.group import TenantGroup
from timeslice_verl.log import get_logger

log = get_logger("agent")


async def probe(self: Tenancy) -> bool:
    """Ask each server of an awake tenant the state it is in; True when what the agent records changed."""
    if self.tenant is None or self.record is None or self.record.state != AWAKE:
        self._misses.clear()
        return False
    members = getattr(self.tenant, "live_members", None) or [self.tenant]
    seq, tenant = self.journal.seq, self.tenant
    answers = await asyncio.gather(*(m.observe(self.probe_timeout_s) for m in members), return_exceptions=True)
    if self.journal.seq != seq or self.tenant is not tenant or self.state != AWAKE or self.step_lock.locked():
        return False  # a move ran meanwhile: what the probe saw may be the move's doing
    changed = False
    for member, answer in zip(members, answers):
        changed |= _probed(self, member, answer)
    return changed

def _probed(self: Tenancy, member: VllmTenant, answer: Any) -> bool:
    url = member.url
    if isinstance(answer, TenantDead) and tenant_proc.still_running(member.process):
        answer = None  # its listener is gone but the process (and its GPU memory) is not: a miss, not a death
    if isinstance(answer, TenantDead):
        log.warning("tenant %s does not answer (connection refused or closed) while it had the GPU", url)
        if isinstance(self.tenant, TenantGroup):
            self.tenant.dead.add(url)
            return True
        self.record.state, self.record.error = DEAD, str(answer)  # type: ignore[union-attr]
        return True
    if answer is None or isinstance(answer, BaseException):
        self._misses[url] = self._misses.get(url, 0) + 1
        if self._misses[url] >= WEDGED_AFTER and url not in self.wedged:
            self.wedged.add(url)
            log.error("tenant %s is wedged: no answer to %d probes in a row (%.1f s each) while it has the GPU; "
                      "reclaiming it goes straight to the kill", url, self._misses[url], self.probe_timeout_s)
            self.journal.notify("wedged", {"url": url})
            return True
        return False
    self._misses[url] = 0
    if url in self.wedged:
        self.wedged.discard(url)
        log.info("tenant %s answers again: no longer taken for wedged", url)
    if answer == ASLEEP:  # a pause or sleep given up on by the ladder took effect late
        log.warning("tenant %s is asleep or paused while the agent counted it awake: recorded asleep (to be woken)", url)
        self.record.state = ASLEEP  # type: ignore[union-attr]
        return True
    return False


__all__ = ["probe"]
