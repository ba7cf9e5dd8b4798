"""The watchdog: notices what changed without a request — expired prepares, exited processes, a client that did not
come back, a tenant that answers again or stopped answering, a trainer that eats into the room beside a tenant held
awake — and wakes the reconciler."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from timeslice_verl.agent import procfs
from timeslice_verl.agent.tenant import probe as tenant_probe
from timeslice_verl.agent.jobs import JobBook
from timeslice_verl.agent.tenant.peaks import Peaks
from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.state import FROZEN, TRANSITIONING
from timeslice_verl.agent.tenant.tenancy import Tenancy
from timeslice_verl.agent.tenant.revive import reregister, revive_members
from timeslice_verl.agent.tenant.vllm import AWAKE, DEAD
from timeslice_verl.log import get_logger

log = get_logger("agent")


class Watchdog:
    def __init__(self, book: JobBook, tenancy: Tenancy, *, step_lock: asyncio.Lock, interval_s: float,
                 reattach_grace_s: float, probe_interval_s: float, peaks: Peaks,
                 set_current: Callable[[str], None]) -> None:
        self.book, self.tenancy, self.step_lock = book, tenancy, step_lock
        self.interval_s, self.reattach_grace_s, self.probe_interval_s = interval_s, reattach_grace_s, probe_interval_s
        self.peaks, self.set_current = peaks, set_current
        self._next_tenant_probe = 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.watch_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # pragma: no cover
                log.exception("watchdog failed")

    async def watch_once(self) -> None:
        now = time.monotonic()
        changed = False
        for name, job in list(self.book.jobs.items()):
            changed |= self._watch_job(name, job, now)
        changed |= await self._watch_tenant(now)
        changed |= self.peaks.sample(self.book.jobs.values(), self.tenancy.held)  # a held tenant must sleep
        if changed:
            self.book.persist()
            self.book.wake()

    def _watch_job(self, name: str, job: Any, now: float) -> bool:
        changed = False
        if job.holding and job.attached is None and job.orphaned_at and now - job.orphaned_at > self.reattach_grace_s:
            log.warning("job %s held the GPU before the agent restarted and its client did not come back within "
                        "%.0f s: releasing", name, self.reattach_grace_s)
            job.holding, job.orphaned_at = False, now  # frozen next; thawed if nobody comes back
            changed = True
        elif (job.state == FROZEN and not job.holding and not job.ending and job.attached is None and job.orphaned_at
                and now - job.orphaned_at > self.reattach_grace_s and job.pids()):
            # its client is gone (a killed leader rank, a crashed trainer) and did not come back: nobody would ever
            # acquire it again, so its processes are thawed and the job ends as if released with done
            log.warning("job %s: frozen with no client for %.0f s: thawing its processes %s and ending the job",
                        name, self.reattach_grace_s, job.pids())
            job.ending, job.orphaned_at = True, 0.0
            changed = True
        if job.prepared_until and job.prepared_until <= now:
            job.prepared_until = 0.0
            changed = True
        return self._watch_processes(name, job) or changed

    def _watch_processes(self, name: str, job: Any) -> bool:
        known = job.procs + job.registered
        if not known:
            # Forget only a job that was frozen with nothing to freeze: a running one is first frozen (its tagged
            # processes may still be on the GPU), and one being frozen is left alone.
            if job.attached is None and not job.holding and name not in self.book.queue and job.state == FROZEN and not job.busy:
                del self.book.jobs[name]
                return True
            return False
        try:
            live_procs = [p for p in job.procs if procfs.alive(p)]
            live_reg = [p for p in job.registered if procfs.alive(p)]
        except procfs.ProcUnreadable as exc:  # EMFILE and the like: learn nothing from this look
            log.warning("watchdog: %s; job %s is left as it is", exc, name)
            return False
        if len(live_procs) + len(live_reg) == len(known):
            return False
        job.procs, job.registered = live_procs, live_reg
        if not job.pids() and job.state != TRANSITIONING:
            log.warning("job %s: all its processes exited%s", name, " while holding the GPU: releasing" if job.holding else "")
            job.holding = False
            job.state, job.frozen_bytes = "RUNNING", 0
            if job.attached is None and name not in self.book.queue:
                del self.book.jobs[name]
        return True

    async def _watch_tenant(self, now: float) -> bool:
        t = self.tenancy
        changed = False
        if t.record is not None and t.record.state == TENANT_FAULTED and now >= t.retry_at:
            changed = True  # the backoff after a failed move is over: let the reconciler retry
        if (t.tenant is not None and t.record and t.record.state in (DEAD, TENANT_FAULTED) and now >= t.next_probe
                and not self.step_lock.locked() and not t.lock.locked()):
            t.next_probe = now + 5.0
            if await reregister(t):
                changed = True
        if (self.probe_interval_s and t.state == AWAKE and now >= self._next_tenant_probe
                and not self.step_lock.locked() and not t.lock.locked()):
            self._next_tenant_probe = now + self.probe_interval_s
            changed |= await tenant_probe.probe(t)
        if now >= t.next_probe and not self.step_lock.locked():
            if getattr(t.tenant, "dead", None):
                t.next_probe = now + 5.0
            if await revive_members(t, self.set_current):
                changed = True
        return changed


__all__ = ["Watchdog"]
