"""Restart recovery: what the persisted state says, checked against what the driver reports now.
"""

from __future__ import annotations

import asyncio
import os
import time

from timeslice_verl.agent import procfs
from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.state import FAULTED, FROZEN, RUNNING, TRANSITIONING, Job, TenantRecord
from timeslice_verl.agent.tenant import ASLEEP, DEAD, TenantError
from timeslice_verl.agent.freeze.base import ProcState, ThawError
from timeslice_verl.log import get_logger
from timeslice_verl.names import split_urls

log = get_logger("agent")

SHUTDOWN_STEP_S = 10.0
"""How long shutdown waits for each step (a transition to stop, the tenant to wake) before going on."""


START_REGISTER_S = 5.0
"""How long the agent's start waits for the configured tenant to answer its registration."""


class RecoveryMixin:
    """Start: bring recorded jobs back to a consistent state, wake a tenant left asleep, start the loops.
    Shutdown: thaw every frozen job and wake the tenant, so nothing is left frozen."""

    async def start(self, tenant_url: str = "", sleep_level: int = 1) -> None:
        """Reconcile the persisted state with reality, then start the reconciler and the watchdog."""
        self.configured_tenant_url = ",".join(split_urls(tenant_url)) if tenant_url else ""
        jobs, tenant_rec, extra = self.store.load()
        for name in extra.get("salvaged_jobs", []):  # the record is lost: thaw what this agent may have frozen
            await self._thaw_tagged(name)
        await self._thaw_salvaged(extra.get("salvaged_procs", []))
        for job in jobs.values():
            await self._reconcile_job(job)
        self.jobs = {name: job for name, job in jobs.items() if job.procs or job.registered or job.holding}
        for job in self.jobs.values():  # its client must come back to keep the GPU, or to keep it frozen (watchdog)
            job.orphaned_at = time.monotonic()
        url, level = tenant_url, sleep_level
        if tenant_rec and tenant_rec.url.rstrip("/") != self.configured_tenant_url:
            if tenant_url:  # the configured tenant replaces the recorded one: never leave that one asleep
                await self._wake_forgotten(tenant_rec)
            else:
                url, level = tenant_rec.url, tenant_rec.sleep_level
        if url:
            try:  # a tenant that hangs never holds up the agent's start: it is retried like a dead one
                await asyncio.wait_for(self.register_tenant(url, level, persist=False), START_REGISTER_S)
            except (TenantError, ProtocolError, asyncio.TimeoutError) as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    exc = TenantError(f"no answer within {START_REGISTER_S:g} s")
                log.error("tenant %s: %s (will retry)", url, exc)
                self.tenant = self._make_tenant(url, level)
                self.tenant_rec = TenantRecord(url=url, state=DEAD, sleep_level=level, error=str(exc))
        self._persist()
        self.store.start_writer()  # from now on the state file is written off the event loop
        self._tasks = [asyncio.create_task(self._reconciler(), name="reconciler"), asyncio.create_task(self._watchdog(), name="watchdog")]
        self.wake()

    async def shutdown(self) -> None:
        """Stop serving; thaw every frozen job and wake the tenant, so nothing is left frozen. Once."""
        if self.shutting_down:
            return
        self.shutting_down = True
        for _name, fut in list(self.waiters.items()):
            if not fut.done():
                fut.set_exception(ProtocolError(ErrorCode.SHUTTING_DOWN, "the agent is shutting down"))
        self.queue.clear()
        self.waiters.clear()
        if self.current.startswith("tenant"):  # an HTTP call to the tenant (maybe hanging): safe to cancel
            for task in self._tasks:
                task.cancel()
        # A freeze or thaw in progress finishes first (its driver calls have timeouts): cancelling the
        # coroutine would not stop the driver thread, and thawing beside it could race it.
        await self._step_lock.acquire()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, SHUTDOWN_STEP_S)
            except (asyncio.CancelledError, asyncio.TimeoutError, Exception):
                pass
        for job in list(self.jobs.values()):
            if job.state in (FROZEN, FAULTED, TRANSITIONING) and job.pids():
                try:
                    await self._thaw(job, reason="agent shutdown")
                except Exception as exc:
                    log.error("shutdown: job %s could not be thawed: %s", job.name, exc)
        if self.tenant is not None and self.tenant_rec and self.tenant_rec.state in (ASLEEP, TENANT_FAULTED):
            try:
                await asyncio.wait_for(self._tenant_reclaim(check_memory=True), SHUTDOWN_STEP_S)
            except (Exception, asyncio.TimeoutError) as exc:
                log.error("shutdown: tenant could not be woken: %r", exc)
        self._persist()
        await asyncio.to_thread(self.store.close)  # the last state is on disk before the agent exits
        if self.tenant is not None:
            await self.tenant.close()
        self.backend.close()
        self._step_lock.release()

    async def _wake_forgotten(self, record: TenantRecord) -> None:
        old = self._make_tenant(record.url, record.sleep_level)
        try:
            await old.register()
            if old.state == ASLEEP:
                await old.reclaim()
                log.info("restart: woke the previously registered tenant %s before switching tenants", record.url)
        except TenantError as exc:
            log.info("restart: previously registered tenant %s: %s", record.url, exc)
        finally:
            await old.close()

    async def _thaw_salvaged(self, procs: list[procfs.ProcId]) -> None:
        """Thaw the processes a broken state file still names (a registered worker carries no tag), each only
        if it is still the very process recorded (same start time) and the driver reports it frozen."""
        await self._thaw_frozen([p.pid for p in procs if procfs.identify(p.pid) == p], "the processes it still named")

    async def _thaw_tagged(self, name: str) -> None:
        """Thaw the processes tagged for job ``name`` that the driver does not report as running."""
        pids = await asyncio.to_thread(self.backend.discover, name, [], {os.getpid()})
        await self._thaw_frozen(pids, f"job {name}'s processes")

    async def _thaw_frozen(self, pids: list[int], what: str) -> None:
        """After a broken state file: thaw those of ``pids`` the driver reports locked or checkpointed."""
        if not pids:
            return
        states = await asyncio.to_thread(self.backend.states, pids)
        frozen = [pid for pid, state in states.items() if state in (ProcState.CHECKPOINTED, ProcState.LOCKED)]
        if not frozen:
            return
        try:
            await asyncio.to_thread(self.backend.thaw, frozen)
            log.warning("restart: the state file was invalid; thawed %s: %s", what, frozen)
        except ThawError as exc:
            log.error("restart: could not thaw %s %s: %s", what, frozen, exc)

    async def _reconcile_job(self, job: Job) -> None:
        before = (job.state, [p.pid for p in job.procs])
        job.procs = [p for p in job.procs if procfs.alive(p)]
        job.registered = [p for p in job.registered if procfs.alive(p)]
        pids = job.pids()
        job.direction = ""
        if not pids:
            job.state, job.frozen_bytes = RUNNING, 0
            log.info("restart: job %s has no live process any more (was %s %s)", job.name, *before)
            return
        states = await asyncio.to_thread(self.backend.states, pids)
        values = set(states.values()) - {ProcState.GONE}
        if values == {ProcState.CHECKPOINTED}:
            job.state = FROZEN
        elif values <= {ProcState.RUNNING}:
            job.state = RUNNING
        elif ProcState.FAILED in values:
            job.state, job.fault = FAULTED, f"driver reports FAILED for pid(s) {[p for p, s in states.items() if s == ProcState.FAILED]}"
        else:  # interrupted mid-transition: bring the job back to running, consistently
            try:
                await asyncio.to_thread(self.backend.thaw, pids, self._identities(job))
                job.state = RUNNING
            except ThawError as exc:
                job.state = FROZEN if exc.still_frozen else FAULTED
                job.fault = f"restart recovery: {exc}"
        log.info("restart: job %s was %s, processes %s are %s -> %s", job.name, before[0], pids,
                 sorted({s.value for s in states.values()}), job.state)

