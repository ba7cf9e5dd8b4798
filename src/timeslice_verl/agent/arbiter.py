"""The arbiter: the request API and the reconciler, over parts that own their state.

* :class:`~timeslice_verl.agent.jobs.JobBook` — the jobs, the FIFO queue, their clients;
* :class:`~timeslice_verl.agent.executor.Executor` — freeze and thaw of a job's processes;
* :class:`~timeslice_verl.agent.tenant.tenancy.Tenancy` — the tenant, its moves and what the agent sees of it;
* :class:`~timeslice_verl.agent.journal.Journal` — every move made, for the clients and the metrics;
* :class:`~timeslice_verl.agent.recovery.Recovery` (start, shutdown) and
  :class:`~timeslice_verl.agent.watchdog.Watchdog` (what changes without a request).

Requests (acquire, release, prepare, attach, register, disconnect) only change what the job book records; one
reconciler task asks the pure policy (:mod:`~timeslice_verl.agent.policy`) for the next move and makes it, under
the step lock, re-reading the situation after each, so requests that arrive mid-move are honoured at the next step
instead of racing it. Every change is persisted through :class:`~timeslice_verl.agent.state.StateStore`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from timeslice_verl.agent.executor import Executor
from timeslice_verl.agent.freeze.base import FreezeBackend, ThawError
from timeslice_verl.agent.gpu import NvmlProbe
from timeslice_verl.agent.options import MAX_PREPARE_TTL_S, AgentOptions, TenantOptions
from timeslice_verl.agent.jobs import JobBook
from timeslice_verl.agent.journal import Journal
from timeslice_verl.agent.tenant.peaks import Peaks
from timeslice_verl.agent.policy import FAULTED, FROZEN, TENANT_FAULTED, JobView, MoveKind, World, desired, next_move
from timeslice_verl.agent.client.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.recovery import Parts, Recovery, Tasks
from timeslice_verl.agent.state import RUNNING, Job, StateStore
from timeslice_verl.agent.tenant.tenancy import Tenancy
from timeslice_verl.agent.tenant.vllm import ASLEEP, AWAKE
from timeslice_verl.agent.tenant.warmup import warm_up
from timeslice_verl.agent.watchdog import Watchdog
from timeslice_verl.log import get_logger
from timeslice_verl.names import SwapMode

log = get_logger("agent")

MAX_GPU_BYTES = 2**40
"""Without NVML, what no GPU's memory reaches: the bound on a rank's park figures."""
YIELDING = "tenant yield"
"""What the reconciler does while the tenant gives the GPU back: from its first call the owner is no longer the
tenant, so a batch service stops sending new lines into a server being paused (a busy API server answers the pause
later)."""
WATCH_MAX_S = 30.0
"""The longest a ``watch_owner`` waits before it answers with the owner unchanged."""


class Arbiter:
    def __init__(self, backend: FreezeBackend, store: StateStore, *, probe: NvmlProbe | None = None,
                 agent: AgentOptions = AgentOptions(), tenant: TenantOptions = TenantOptions()) -> None:
        self.store, self.probe = store, probe
        self.peaks = Peaks(probe, tenant.hold)
        self.prepare_ttl_s = min(agent.prepare_ttl_s, MAX_PREPARE_TTL_S)
        self.step_lock = asyncio.Lock()
        self.journal = Journal()
        self.book = JobBook(wake=self.wake, persist=self.persist, seq=lambda: self.journal.seq)
        self.executor = Executor(backend, self.journal, probe=probe, park_overhead_bytes=agent.park_overhead_bytes,
                                 persist=self.persist, still_known=lambda job: self.book.jobs.get(job.name) is job,
                                 client_pids=lambda job: self.book.client_pids(job, backend.frees_gpu_memory))
        self.tenancy = Tenancy(self.journal, step_lock=self.step_lock, persist=self.persist, wake=self.wake,
                               trainer_waiting=lambda: self.book.queue[0] if self.book.queue else None, room=self._room,
                               options=tenant)
        self.recovery = Recovery(Parts(self.book, self.executor, self.journal, store, self.tenancy, self.step_lock,
                                       self.persist), agent.shutdown_timeout_s)
        self.watchdog = Watchdog(self.book, self.tenancy, step_lock=self.step_lock, interval_s=agent.watch_interval_s,
                                 reattach_grace_s=agent.reattach_grace_s, probe_interval_s=tenant.probe_interval_s,
                                 peaks=self.peaks, set_current=self.set_current)
        self.reclaim_deadline_s = tenant.reclaim_deadline_s
        self.current = ""
        self.started = time.time()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._moved = asyncio.Event()
        self.journal.listeners.append(lambda kind, data: self._moved.set())
        self._tasks: list[asyncio.Task] = []

    # ================================================================== start and stop

    async def start(self, tenant_urls: list[str] | None = None, sleep_level: int = 1) -> None:
        await self.recovery.start(tenant_urls or [], sleep_level)
        self._tasks = [asyncio.create_task(self._reconciler(), name="reconciler"),
                       asyncio.create_task(self.watchdog.run(), name="watchdog")]
        self.wake()

    async def shutdown(self) -> None:
        """Stop serving; thaw every frozen job and wake the tenant (once)."""
        if self.book.closed:
            return
        await self.recovery.shutdown(Tasks(cancel=self.cancel_tasks, stop=self.stop_tasks, moving=lambda: self.current))

    def cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def stop_tasks(self, timeout_s: float) -> None:
        self.cancel_tasks()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, timeout_s)
            except (asyncio.CancelledError, asyncio.TimeoutError, Exception):
                pass

    # ================================================================== requests

    def connection_opened(self, conn: int, peer_pid: int | None = None) -> None:
        self.book.opened(conn, peer_pid)

    def disconnect(self, conn: int) -> None:
        self.book.disconnect(conn)

    def register_pids(self, name: str, pids: list[int], conn: int | None, peer_uid: int | None) -> dict[str, Any]:
        job = self.book.register_pids(name, pids, conn, peer_uid)
        return {"job": name, "pids": sorted(p.pid for p in job.registered)}

    async def acquire(self, name: str, conn: int | None, *, timeout_s: float | None = None, pids: list[int] | None = None,
                      peer_uid: int | None = None) -> dict[str, Any]:
        job = self.book.job(name, conn, peer_uid)
        if pids:
            self.book.register_pids(name, pids, conn, peer_uid)
        t0, seq0 = time.monotonic(), self.journal.seq
        if not job.holding:
            await self.book.wait_for_grant(name, timeout_s)
        waited = time.monotonic() - t0
        self.journal.notify("acquire", {"job": name, "waited_s": waited})
        thaws = [t for t in self.journal.since(seq0) if t.action == "thaw" and t.subject == name]
        return {
            "job": name, "waited_s": round(waited, 6), "thawed": bool(thaws),
            "thaw_s": round(sum(t.seconds for t in thaws), 6),
            "restore_s": round(sum(t.phases.get("restore", 0.0) for t in thaws), 6),
            "frozen_bytes": job.frozen_bytes, "transitions": self.journal.report(job),
            # the names of 0.1, for its clients: "restored" meant thawed
            "restored": bool(thaws), "bytes": job.frozen_bytes,
        }

    def attach(self, name: str, conn: int | None, *, holding: bool = False, peer_uid: int | None = None) -> dict[str, Any]:
        """A client (back after this agent restarted) says the job is its own, and whether it holds the GPU. A
        holder keeps the GPU however long its step lasts; one this agent no longer counts as holding (its record
        was lost, or the grace ran out) gets the GPU back at once, as if it had asked."""
        job = self.book.jobs.get(name)
        if job is None and not holding:
            return {"job": name, "attached": False, "holding": False}
        job = self.book.job(name, conn, peer_uid)
        if holding and not job.holding:
            log.warning("job %s: its client holds the GPU by its own account, this agent did not count it: giving the "
                        "GPU back to it", name)
            self.book.enqueue(name)
        elif holding:
            log.info("job %s: its client came back and holds the GPU", name)
        self.persist()
        return {"job": name, "attached": True, "holding": job.holding, "queued": name in self.book.queue}

    async def release(self, name: str, conn: int | None, *, wait: bool = False, done: bool = False,
                      swap: SwapMode = SwapMode.checkpoint, parked: list[dict[str, int]] | None = None) -> dict[str, Any]:
        job = self.book.jobs.get(name)
        if job is None:
            return {"job": name, "released": False, "transitions": []}
        self.book.job(name, conn)
        if swap is not SwapMode.checkpoint and not parked and not done:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"swap {swap!r} needs 'parked': what each worker parked and kept")
        self._check_park_reports(parked or [])
        if not done or job.holding:  # a done after a release says nothing of how its freeze (maybe under way) swaps
            job.swap = swap
            job.parked = {int(r["pid"]): int(r["kept"]) for r in parked or []}
            job.parked_bytes = sum(int(r["parked"]) for r in parked or [])
        if job.holding:
            self.peaks.sample([job], held=False)  # what it holds as it lets go (a resident trainer's allocator cache)
        was_holding, job.holding = job.holding, False
        job.ending = job.ending or done
        job.refused = ""  # a new valley: try the freeze again
        job.prepared_until = 0.0
        if name in self.book.queue:
            self.book.drop_waiter(name, ProtocolError(ErrorCode.BUSY, f"job {name!r} was released while waiting"))
        if was_holding:
            log.info("release: job %s", name)
        self.persist()
        self.wake()
        if wait:
            await self.settled()
        return {"job": name, "released": was_holding, "transitions": self.journal.report(job)}

    def _check_park_reports(self, parked: list[dict[str, int]]) -> None:
        """A rank can neither have parked nor still keep more than one of the agent's GPUs holds: such a figure is
        refused here, before it can pass a footprint check or block every later thaw."""
        gpu, where = (self.probe.largest_gpu(), "one of the agent's GPUs holds") if self.probe is not None else \
            (MAX_GPU_BYTES, "any GPU holds")
        for r in parked:
            for key in ("parked", "kept"):
                if int(r[key]) > gpu:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"field 'parked': pid {r['pid']} reports {key}="
                                        f"{int(r[key]) / 2**30:.2f} GiB, more than {where} ({gpu / 2**30:.2f} GiB)")

    def prepare(self, name: str, conn: int | None, ttl_s: float | None = None) -> dict[str, Any]:
        job = self.book.job(name, conn)
        if job.holding:
            return {"job": name, "accepted": False, "reason": "already holding the GPU"}
        ttl = min(ttl_s or self.prepare_ttl_s, self.prepare_ttl_s)  # a prepare never keeps the tenant asleep for long
        job.prepared_until = time.monotonic() + ttl
        self.wake()
        return {"job": name, "accepted": True, "ttl_s": ttl}

    async def register_tenant(self, urls: list[str], sleep_level: int = 1, **kwargs: Any) -> dict[str, Any]:
        return await self.tenancy.register(urls, sleep_level, **kwargs)

    async def unregister_tenant(self) -> dict[str, Any]:
        return await self.tenancy.unregister()

    # ================================================================== the reconciler

    def wake(self) -> None:
        self._idle.clear()
        self._wake.set()
        self._moved.set()

    def persist(self) -> None:
        try:
            self.store.save(self.book.jobs, self.tenancy.record, {"queue": list(self.book.queue)})
        except OSError as exc:  # pragma: no cover - disk full etc.
            log.error("could not write state file %s: %s", self.store.path, exc)

    def set_current(self, what: str) -> None:
        self.current = what

    async def settled(self, timeout_s: float = 600.0) -> None:
        """Wait until the reconciler has nothing left to do and the state it left is on disk."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)
        await asyncio.to_thread(self.store.flush, timeout_s)

    async def _reconciler(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                try:
                    async with self.step_lock:
                        acted = await self._step()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a bug must not kill the agent: log it, fail the waiters
                    log.exception("reconciler step failed")
                    for name in list(self.book.queue):
                        self.book.drop_waiter(name, ProtocolError(ErrorCode.INTERNAL, f"agent error: {exc}"))
                    acted = False
                if not acted:
                    break
            if not self._wake.is_set():
                self._idle.set()

    def _world(self) -> World:
        """The policy's view of the jobs, the queue and the tenant."""
        tenant = self.tenancy.state
        jobs = tuple(JobView(name=j.name, state=j.state, holding=j.holding, queued=j.name in self.book.queue,
                             prepared_until=j.prepared_until, refused=bool(j.refused), ending=j.ending,
                             has_pids=bool(j.pids()), needs_room=bool(j.frozen_bytes or j.parked_bytes))
                     for j in self.book.jobs.values())
        held = self.tenancy.held
        room = self._room(self.tenancy.footprint) if tenant in (ASLEEP, TENANT_FAULTED) and not held else True
        return World(jobs=jobs, queue_head=self.book.queue[0] if self.book.queue else None, tenant=tenant,
                     room_for_tenant=room, now=time.monotonic(), tenant_retry_at=self.tenancy.retry_at,
                     tenant_warm_up=self.tenancy.warm_up_due, tenant_held=held, tenant_tight=held and self.peaks.tight)

    async def _step(self) -> bool:
        """Make the policy's next move; False when there is none."""
        world = self._world()
        move = next_move(world)
        if move is None:
            return False
        job = self.book.jobs.get(move.job) if move.job else None
        if move.kind in (MoveKind.forget, MoveKind.thaw_ended) and job is not None:
            return await self._end(job, thaw=move.kind is MoveKind.thaw_ended)
        free = self._free if self.probe else None
        if move.kind is MoveKind.tenant_yield:
            target = desired(world)
            fit = self.peaks.fit(self.book.jobs.get(target.name) if target is not None else None)
            needs_room = target is not None and target.needs_room and target.state in (FROZEN, FAULTED)
            if fit.pause_only and not needs_room:  # nothing moves: the grant need not wait for vLLM's answer
                await self._tenant(YIELDING, self.tenancy.pause_behind(free, fit.why))
            else:
                await self._tenant(YIELDING, self.tenancy.yield_gpu(free, sleep=True, why=fit.why))
        elif move.kind is MoveKind.tenant_sleep:
            why = self.peaks.why if world.tenant_tight else "a thaw brings the trainer's memory back"
            await self._tenant("tenant sleep", self.tenancy.sleep_held(free, why))
        elif move.kind is MoveKind.tenant_warm_up:
            await self._tenant("tenant warm-up", warm_up(self.tenancy, self._free if self.probe else None))
        elif move.kind is MoveKind.tenant_reclaim:
            await self._tenant("tenant reclaim", self.tenancy.reclaim(check_memory=False))
        elif move.kind is MoveKind.freeze and job is not None:
            await self.executor.freeze(job)
        elif move.kind is MoveKind.thaw and job is not None:
            await self._thaw_for(job, move.waiting)
        elif move.kind is MoveKind.recover and job is not None:
            if not await self.executor.running_again(job):
                if not move.waiting:
                    return False
                await self._thaw_for(job, move.waiting)
        elif move.kind is MoveKind.grant and job is not None:
            self.book.grant(job)
        else:  # pragma: no cover - the policy names a job that is gone
            return False
        return True

    async def _tenant(self, what: str, move: Any) -> None:
        await self.tenancy.behind.settled()  # a pause still running behind a grant ends before the next move
        self.current = what
        if what == YIELDING:  # the owner is no longer the tenant: its batch service stops sending at once
            self._moved.set()
        try:
            await move
        finally:
            self.current = ""

    async def _end(self, job: Job, *, thaw: bool) -> bool:
        self.peaks.forget(job.name)
        if thaw:
            try:
                await self.executor.thaw(job, reason="job ended")  # never leave an ended job's processes frozen
            except ThawError:
                job.ending = False  # handled like any frozen job: retried on acquire, at shutdown
                return True
        log.info("job %s ended: forgotten without a freeze", job.name)
        del self.book.jobs[job.name]
        self.persist()
        return True

    async def _thaw_for(self, job: Job, waiting: bool) -> None:
        try:
            await self.executor.thaw(job, reason="grant")
        except ThawError as exc:
            if waiting:
                self.book.drop_waiter(job.name, ProtocolError(ErrorCode.FAULT, f"restore of job {job.name!r} failed: {exc}"))
            else:
                job.prepared_until = 0.0

    def _free(self) -> int:
        return self.probe.memory().free if self.probe is not None else 0

    def _room(self, footprint: int) -> bool:
        return self.probe is None or not footprint or self._free() >= footprint

    # ================================================================== what the agent shows

    def owner(self) -> str:
        jobs = self.book.jobs.values()
        for job in jobs:
            if job.holding and job.state == RUNNING:
                return f"job:{job.name}"
        if self.tenancy.state == AWAKE and self.current != YIELDING:
            return "tenant"
        if self.current or self.executor.current:
            return "transitioning"
        return next((f"job:{j.name}" for j in jobs if j.state == RUNNING and j.pids()), "none")

    async def watch_owner(self, seen: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Answer once the GPU's owner is no longer ``seen``, or after ``timeout_s`` (at most 30 s): a batch service
        learns the moment its tenant has the GPU, and loses it, without polling the status."""
        deadline = time.monotonic() + min(timeout_s or WATCH_MAX_S, WATCH_MAX_S)
        while (owner := self.owner()) == seen and (left := deadline - time.monotonic()) > 0 and not self.book.closed:
            self._moved.clear()  # a shutting-down agent answers at once: its SIGTERM never waits on a watcher
            try:  # every move and every wake-up of the reconciler sets it; the bound covers what sets neither
                await asyncio.wait_for(self._moved.wait(), min(left, 0.25))
            except asyncio.TimeoutError:
                pass
        return {"owner": owner, "tenant": self.tenancy.state}

    def snapshot(self) -> dict[str, Any]:
        t = self.tenancy
        snap: dict[str, Any] = {
            "owner": self.owner(), "transition": self.executor.current or self.current,
            "waiting_for": t.tenant.waiting_for() if t.tenant is not None else "",
            "queue": list(self.book.queue), "jobs": self.book.describe(time.monotonic()), "tenant": t.describe(),
            "ladder": {"deadline_s": self.reclaim_deadline_s, **t.ladder_counts, "last": t.ladder_last},
            "yield_by": {"setting": str(self.peaks.policy.by), "held": t.held,
                         "pause_only": bool(self.peaks.last_fit and self.peaks.last_fit.pause_only),
                         "why": self.peaks.last_fit.why if self.peaks.last_fit else "no yield yet"},
            "transitions": self.journal.seq,
            "bandwidth": {"checkpoint_gbps": self.journal.median_rate("freeze", "checkpoint"),
                          "restore_gbps": self.journal.median_rate("thaw", "restore")},
        }
        uuids = dict(zip(self.probe.indices, self.probe.uuids())) if self.probe is not None else {}
        for job in snap["jobs"]:
            found = self.book.jobs.get(job["name"])
            job["gpus"] = self.executor.gpus_of(found) if found is not None else []
            job["gpu_uuids"] = [uuids[i] for i in job["gpus"] if i in uuids]  # what a tenant supervisor starts vLLM on
        if self.probe is not None:
            mem = self.probe.memory()
            snap["gpu"] = {"total": mem.total, "used": mem.used, "free": mem.free, "driver": self.probe.driver_version}
        return snap


__all__ = ["Arbiter", "MAX_PREPARE_TTL_S"]
