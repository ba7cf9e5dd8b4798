"""The watchdog: notices what changed without a request (expired prepares, exited processes, a tenant back).
"""

from __future__ import annotations

import asyncio
import time

from timeslice_verl.agent import procfs
from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.state import FROZEN, RUNNING, TRANSITIONING  # noqa: F401
from timeslice_verl.agent.tenant import AWAKE, DEAD, TenantError
from timeslice_verl.agent.transitions import ReclaimAbandoned
from timeslice_verl.log import get_logger

log = get_logger("agent")


class WatchdogMixin:
    """Periodic checks of the arbiter's jobs and tenant; wakes the reconciler when something changed."""

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                await self._watch_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # pragma: no cover
                log.exception("watchdog failed")

    async def _watch_once(self) -> None:
        changed = False
        now = time.monotonic()
        for name, job in list(self.jobs.items()):
            if job.holding and job.attached is None and job.orphaned_at and now - job.orphaned_at > self.reattach_grace_s:
                log.warning("job %s held the GPU before the agent restarted and its client did not come back within "
                            "%.0f s: releasing", name, self.reattach_grace_s)
                job.holding, job.orphaned_at = False, now  # frozen next; thawed if nobody comes back
                changed = True
            elif (job.state == FROZEN and not job.holding and not job.ending and job.attached is None and job.orphaned_at
                    and now - job.orphaned_at > self.reattach_grace_s and job.pids()):
                # its client is gone (a killed leader rank, a crashed trainer) and did not come back: nobody
                # would ever acquire it again, so its processes are thawed and the job ends as if released
                # with done (it is forgotten once thawed and never frozen again)
                log.warning("job %s: frozen with no client for %.0f s: thawing its processes %s and ending the job",
                            name, self.reattach_grace_s, job.pids())
                job.ending, job.orphaned_at = True, 0.0
                changed = True
            if job.prepared_until and job.prepared_until <= now:
                job.prepared_until = 0.0
                changed = True
            known = job.procs + job.registered
            if not known:
                # Forget only a job that was frozen with nothing to freeze: a running one is first frozen
                # (its tagged processes may still be on the GPU), and one being frozen is left alone.
                if job.attached is None and not job.holding and name not in self.queue and job.state == FROZEN and not job.busy:
                    del self.jobs[name]
                    changed = True
                continue
            try:
                live_procs = [p for p in job.procs if procfs.alive(p)]
                live_reg = [p for p in job.registered if procfs.alive(p)]
            except procfs.ProcUnreadable as exc:  # EMFILE and the like: learn nothing this round
                log.warning("watchdog: %s; job %s is left as it is", exc, name)
                continue
            if len(live_procs) + len(live_reg) == len(known):
                continue
            job.procs, job.registered = live_procs, live_reg
            changed = True
            if not job.pids() and job.state != TRANSITIONING:
                log.warning("job %s: all its processes exited%s", name, " while holding the GPU: releasing" if job.holding else "")
                job.holding = False
                job.state, job.frozen_bytes = RUNNING, 0
                if job.attached is None and name not in self.queue:
                    del self.jobs[name]
        if self.tenant_rec is not None and self.tenant_rec.state == TENANT_FAULTED and now >= self.tenant_retry_at:
            changed = True  # the backoff after a failed tenant move is over: let the reconciler retry
        if (self.tenant is not None and self.tenant_rec and self.tenant_rec.state in (DEAD, TENANT_FAULTED)
                and now >= self._next_tenant_probe and not self._step_lock.locked() and not self._tenancy_lock.locked()):
            self._next_tenant_probe = now + 5.0
            if await self._reregister():
                changed = True
        if await self._revive_group_members(now):
            changed = True
        if changed:
            self._persist()
            self.wake()

    async def _reregister(self) -> bool:
        """A dead or faulted tenant that answers again is registered again, under the step lock like any
        move (it may have been unregistered or replaced meanwhile)."""
        tenant = self.tenant
        if tenant is None or not await tenant.alive():
            return False
        async with self._tenancy_lock, self._step_lock:
            if self.tenant is not tenant or self.tenant_rec is None:
                return False
            try:  # a trainer that asks meanwhile never waits on a tenant that answers slowly
                info = await self._unless_a_trainer_asks(tenant.register())
            except ReclaimAbandoned:
                return False
            except TenantError as exc:
                self.tenant_rec.error = str(exc)
                return False
            self.tenant_rec.state, self.tenant_rec.version, self.tenant_rec.error = tenant.state, info.version, tenant.note
        log.info("tenant %s answers again (%s)", tenant.url, tenant.state)
        return True

    async def _revive_group_members(self, now: float) -> bool:
        """A tenant group with servers left out: bring back those that answer again (never mid-move)."""
        dead = getattr(self.tenant, "dead", None)
        if not dead or self.tenant_rec is None or self.tenant_rec.state in (DEAD, TENANT_FAULTED):
            return False
        if now < self._next_tenant_probe or self._step_lock.locked():
            return False
        self._next_tenant_probe = now + 5.0
        async with self._step_lock:
            self.current = "tenant revive"
            revive = self.tenant.revive()
            try:
                if self.tenant.state == AWAKE:  # waking a server back never delays a trainer that asks meanwhile
                    back = await self._unless_a_trainer_asks(revive)
                else:  # the trainer holds the GPUs: putting a restarted server to sleep protects it
                    back = await asyncio.wait_for(revive, self.reclaim_deadline_s or None)
            except (ReclaimAbandoned, asyncio.TimeoutError):  # a half-woken server answers the next yield
                back = []
            finally:
                self.current = ""
        self.tenant_rec.error = self.tenant.note
        return bool(back)

