"""Start and shutdown: what the persisted state says, checked against what the driver reports now; and on the way
out, every frozen job thawed and the tenant woken, so nothing is left frozen or asleep."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from timeslice_verl.agent import procfs
from timeslice_verl.agent.freeze.base import ProcState, ThawError
from timeslice_verl.agent.executor import Executor, identities
from timeslice_verl.agent.jobs import JobBook
from timeslice_verl.agent.journal import Journal
from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.client.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.state import FAULTED, FROZEN, RUNNING, TRANSITIONING, Job, StateStore, TenantRecord
from timeslice_verl.agent.tenant.tenancy import Tenancy
from timeslice_verl.agent.tenant.vllm import ASLEEP, TenantError
from timeslice_verl.log import get_logger
from timeslice_verl.names import clean_urls

log = get_logger("agent")

START_REGISTER_S = 5.0
"""How long the agent's start waits for the configured tenant to answer its registration."""


@dataclass
class Parts:
    """What the start and the shutdown bring to a consistent state: the arbiter's parts, passed by value (no
    reference back to the arbiter)."""

    book: JobBook
    executor: Executor
    journal: Journal
    store: StateStore
    tenancy: Tenancy
    step_lock: asyncio.Lock
    persist: Callable[[], None]


@dataclass
class Tasks:
    """The arbiter's background tasks as the shutdown stops them."""

    cancel: Callable[[], None]
    stop: Callable[[float], Awaitable[None]]
    moving: Callable[[], str]
    """What the reconciler is doing now (``tenant …`` while it moves the tenant)."""


class Recovery:
    """The arbiter's start and shutdown (it owns no state: it brings the other parts' to a consistent one)."""

    def __init__(self, parts: Parts, shutdown_timeout_s: float = 10.0) -> None:
        self.a = parts
        self.shutdown_timeout_s = shutdown_timeout_s

    async def start(self, tenant_urls: list[str], sleep_level: int = 1) -> None:
        """Reconcile the persisted state with reality, then start the reconciler and the watchdog."""
        a, t = self.a, self.a.tenancy
        t.configured_urls = clean_urls(tenant_urls)
        jobs, record, extra = a.store.load()
        for name in extra.get("salvaged_jobs", []):  # the record is lost: thaw what this agent may have frozen
            await self._thaw_tagged(name)
        await self._thaw_salvaged(extra.get("salvaged_procs", []))
        for job in jobs.values():
            await self._reconcile_job(job)
        a.book.jobs = {name: job for name, job in jobs.items() if job.procs or job.registered or job.holding}
        for job in a.book.jobs.values():  # its client must come back to keep the GPU, or to keep it frozen (watchdog)
            job.orphaned_at = time.monotonic()
            job.cursor = a.journal.seq
        urls, level = t.configured_urls, sleep_level
        if record and clean_urls(record.urls) != t.configured_urls:
            if t.configured_urls:  # the configured tenant replaces the recorded one: never leave that one asleep
                await self._wake_forgotten(record)
            else:
                urls, level = record.urls, record.sleep_level
        if urls:
            try:  # a tenant that hangs never holds up the agent's start: it is retried like a dead one
                await asyncio.wait_for(t.register(urls, level, persist=False), START_REGISTER_S)
            except (TenantError, ProtocolError, asyncio.TimeoutError) as exc:
                why = f"no answer within {START_REGISTER_S:g} s" if isinstance(exc, asyncio.TimeoutError) else str(exc)
                # expected when the agent starts first (the quick start's order): not an error until it lasts
                log.warning("tenant %s is not up yet: %s; the agent takes it when it answers (or its supervisor "
                            "registers it)", urls, why)
                t.adopt_dead(urls, level, why)
        a.persist()
        a.store.start_writer()  # from now on the state file is written off the event loop

    async def shutdown(self, tasks: Tasks) -> None:
        """Stop serving; thaw every frozen job and wake the tenant, so nothing is left frozen. Once."""
        a = self.a
        a.book.closed = True
        a.book.fail_all(ProtocolError(ErrorCode.SHUTTING_DOWN, "the agent is shutting down"))
        if a.executor.current.startswith("tenant") or tasks.moving().startswith("tenant"):
            tasks.cancel()  # an HTTP call to the tenant (maybe hanging): safe to cancel
        # A freeze or thaw in progress finishes first (its driver calls have timeouts): cancelling the coroutine
        # would not stop the driver thread, and thawing beside it could race it.
        await a.step_lock.acquire()
        try:
            await tasks.stop(self.shutdown_timeout_s)
            for job in list(a.book.jobs.values()):
                if job.state in (FROZEN, FAULTED, TRANSITIONING) and job.pids():
                    try:
                        await a.executor.thaw(job, reason="agent shutdown")
                    except Exception as exc:
                        log.error("shutdown: job %s could not be thawed: %s", job.name, exc)
            t = a.tenancy
            try:  # a pause behind a grant lands first (its ladder has its own deadline)
                await asyncio.wait_for(t.behind.settled(), self.shutdown_timeout_s)
            except asyncio.TimeoutError:
                log.error("shutdown: the tenant's pause behind the last grant did not end within %g s",
                          self.shutdown_timeout_s)
            if t.tenant is not None and t.record and t.record.state in (ASLEEP, TENANT_FAULTED):
                try:
                    await asyncio.wait_for(t.reclaim(check_memory=True), self.shutdown_timeout_s)
                except (Exception, asyncio.TimeoutError) as exc:
                    log.error("shutdown: tenant could not be woken: %r", exc)
            a.persist()
            await asyncio.to_thread(a.store.close)  # the last state is on disk before the agent exits
            await t.close()
            a.executor.backend.close()
        finally:
            a.step_lock.release()

    async def _wake_forgotten(self, record: TenantRecord) -> None:
        old = self.a.tenancy.make(record.urls, record.sleep_level)
        try:
            await old.register()
            if old.state == ASLEEP:
                await old.reclaim()
                log.info("restart: woke the previously registered tenant %s before switching tenants", record.urls)
        except TenantError as exc:
            log.info("restart: previously registered tenant %s: %s", record.urls, exc)
        finally:
            await old.close()

    async def _thaw_salvaged(self, procs: list[procfs.ProcId]) -> None:
        """Thaw the processes a broken state file still names (a registered worker carries no tag), each only if it
        is still the very process recorded (same start time) and the driver reports it frozen."""
        await self._thaw_frozen([p.pid for p in procs if procfs.identify(p.pid) == p], "the processes it still named")

    async def _thaw_tagged(self, name: str) -> None:
        """Thaw the processes tagged for job ``name`` that the driver does not report as running."""
        pids = await asyncio.to_thread(self.a.executor.backend.discover, name, [], {os.getpid()})
        await self._thaw_frozen(pids, f"job {name}'s processes")

    async def _thaw_frozen(self, pids: list[int], what: str) -> None:
        """After a broken state file: thaw those of ``pids`` the driver reports locked or checkpointed."""
        if not pids:
            return
        backend = self.a.executor.backend
        states = await asyncio.to_thread(backend.states, pids)
        frozen = [pid for pid, state in states.items() if state in (ProcState.CHECKPOINTED, ProcState.LOCKED)]
        if not frozen:
            return
        try:
            await asyncio.to_thread(backend.thaw, frozen)
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
        backend = self.a.executor.backend
        states = await asyncio.to_thread(backend.states, pids)
        values = set(states.values()) - {ProcState.GONE}
        if values == {ProcState.CHECKPOINTED}:
            job.state = FROZEN
        elif values <= {ProcState.RUNNING}:
            job.state = RUNNING
        elif ProcState.FAILED in values:
            job.state, job.fault = FAULTED, f"driver reports FAILED for pid(s) {[p for p, s in states.items() if s == ProcState.FAILED]}"
        else:  # interrupted mid-transition: bring the job back to running, consistently
            try:
                await asyncio.to_thread(backend.thaw, pids, identities(job))
                job.state = RUNNING
            except ThawError as exc:
                job.state = FROZEN if exc.still_frozen else FAULTED
                job.fault = f"restart recovery: {exc}"
        log.info("restart: job %s was %s, processes %s are %s -> %s", job.name, before[0], pids,
                 sorted({s.value for s in states.values()}), job.state)


__all__ = ["Recovery", "START_REGISTER_S"]
