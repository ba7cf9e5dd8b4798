"""The request API and the reconciler: who asked for the GPU, and the single worker that moves it.

Requests (acquire, release, prepare, register, disconnect) only change the recorded wishes; one
reconciler task asks the pure policy (:mod:`~timeslice_verl.agent.policy`) for the next move and
makes it (:mod:`~timeslice_verl.agent.transitions`), re-reading the situation after each, so requests
that arrive mid-transition are honoured at the next step instead of racing it. Start and shutdown
live in :mod:`~timeslice_verl.agent.recovery`, periodic checks in :mod:`~timeslice_verl.agent.watchdog`.
Every change is persisted through :class:`~timeslice_verl.agent.state.StateStore`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any, Callable

from timeslice_verl.agent import procfs
from timeslice_verl.agent.gpu import NvmlProbe
from timeslice_verl.agent.policy import TENANT_FAULTED, JobView, World, next_move
from timeslice_verl.agent.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.recovery import RecoveryMixin
from timeslice_verl.agent.snapshot import SnapshotMixin
from timeslice_verl.agent.tenancy import TenancyMixin
from timeslice_verl.agent.state import Job, StateStore, TenantRecord
from timeslice_verl.agent.tenant import ASLEEP, TenantGroup, VllmTenant
from timeslice_verl.agent.freeze.base import ThawError, FreezeBackend
from timeslice_verl.agent.transitions import TransitionsMixin
from timeslice_verl.agent.watchdog import WatchdogMixin
from timeslice_verl.events import Transition
from timeslice_verl.log import get_logger

log = get_logger("agent")


MAX_JOBS_PER_CLIENT = 16
"""Job names one connection may create (a trainer uses one): thousands of idle names would each cost a /proc scan."""
MAX_JOBS = 256


MAX_GPU_BYTES = 2**40
"""Without NVML, what no GPU's memory reaches: the bound on a rank's park figures."""


class Arbiter(RecoveryMixin, TenancyMixin, TransitionsMixin, WatchdogMixin, SnapshotMixin):
    def __init__(
        self,
        backend: FreezeBackend,
        store: StateStore,
        *,
        probe: NvmlProbe | None = None,
        tenant_request_timeout_s: float = 30.0,
        tenant_drain_timeout_s: float = 600.0,
        tenant_pause_mode: str = "keep",
        reclaim_deadline_s: float = 10.0,
        prepare_ttl_s: float = 60.0,
        watch_interval_s: float = 0.2,
        reattach_grace_s: float = 60.0,
        park_overhead_bytes: int = 3 * 2**30,
    ) -> None:
        self.reattach_grace_s = reattach_grace_s
        self.park_overhead_bytes = park_overhead_bytes
        self.configured_tenant_url = ""
        """The tenant URL of the agent's own config: the one URL a client may not choose freely."""
        self.backend = backend
        self.store = store
        self.probe = probe
        self.tenant_request_timeout_s = tenant_request_timeout_s
        self.tenant_drain_timeout_s = tenant_drain_timeout_s
        self.tenant_pause_mode = tenant_pause_mode
        self.reclaim_deadline_s = reclaim_deadline_s
        """The longest a tenant's yield may take: past it the agent goes down the ladder (agent/ladder.py)."""
        self.ladder_counts: dict[str, int] = {}
        self.ladder_last = ""
        self.prepare_ttl_s = prepare_ttl_s
        self.watch_interval_s = watch_interval_s
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.waiters: dict[str, asyncio.Future] = {}
        self.tenant: VllmTenant | TenantGroup | None = None
        self.tenant_rec: TenantRecord | None = None
        self.tenant_bytes = 0
        self.transitions: deque[tuple[int, Transition]] = deque(maxlen=4096)
        self.seq = 0
        self.current = ""
        self.shutting_down = False
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._tenancy_lock = asyncio.Lock()
        """Held by a tenant registration or unregistration (one at a time; taken before the step lock)."""
        self._peers: dict[int, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._live_connections: set[int] = set()
        self._next_tenant_probe = 0.0
        self.tenant_backoff_s = 0.0
        self.tenant_retry_at = 0.0
        self._waiting: dict[str, int] = {}
        self.started = time.time()

    # ================================================================== requests

    def connection_opened(self, conn: int, peer_pid: int | None = None) -> None:
        self._live_connections.add(conn)
        if peer_pid:
            self._peers[conn] = peer_pid

    def _job(self, name: str, conn: int | None, peer_uid: int | None = None) -> Job:
        if self.shutting_down:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the agent is shutting down")
        job = self.jobs.get(name)
        if job is None:
            mine = sum(1 for j in self.jobs.values() if conn is not None and j.attached == conn)
            if mine >= MAX_JOBS_PER_CLIENT or len(self.jobs) >= MAX_JOBS:
                raise ProtocolError(ErrorCode.BUSY, f"too many jobs ({mine} of this client, {len(self.jobs)} in all; the limits "
                                    f"are {MAX_JOBS_PER_CLIENT} and {MAX_JOBS}): one trainer needs one job name")
            job = self.jobs[name] = Job(name=name, cursor=self.seq)
        if conn is not None:
            if job.attached not in (None, conn) and job.attached in self._live_connections:
                raise ProtocolError(ErrorCode.BUSY, f"job {name!r} is in use by another client of this agent")
            job.attached = conn
            job.orphaned_at = 0.0  # its client is back
        if peer_uid is not None and job.owner_uid is None:
            job.owner_uid = peer_uid
        return job

    def register_pids(self, name: str, pids: list[int], conn: int | None, peer_uid: int | None) -> dict[str, Any]:
        job = self._job(name, conn, peer_uid)
        for pid in pids:
            proc = procfs.identify(pid)
            if proc is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"pid {pid} does not exist")
            if pid == os.getpid():
                raise ProtocolError(ErrorCode.PERMISSION, "the agent will not freeze itself")
            owner = procfs.uid_of(pid)
            if peer_uid not in (None, 0) and owner != peer_uid:
                raise ProtocolError(ErrorCode.PERMISSION, f"pid {pid} belongs to uid {owner}, not to the requesting uid {peer_uid}")
            if not procfs.is_thread_group_leader(pid):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"pid {pid} is a thread, not a process (thread-group leader)")
            if proc not in job.registered:
                job.registered.append(proc)
        self._persist()
        return {"job": name, "pids": sorted(p.pid for p in job.registered)}

    async def acquire(
        self, name: str, conn: int | None, *, timeout_s: float | None = None, pids: list[int] | None = None, peer_uid: int | None = None
    ) -> dict[str, Any]:
        job = self._job(name, conn, peer_uid)
        if pids:
            self.register_pids(name, pids, conn, peer_uid)
        t0 = time.monotonic()
        seq0 = self.seq
        if not job.holding:
            fut = self._enqueue(name)
            self._waiting[name] = self._waiting.get(name, 0) + 1  # acquires of this job waiting on fut
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout=timeout_s or None)
            except asyncio.TimeoutError:
                self._stop_waiting(name)
                raise ProtocolError(ErrorCode.TIMEOUT, f"job {name!r} did not get the GPU within {timeout_s:g} s") from None
            except asyncio.CancelledError:
                self._stop_waiting(name)
                raise
        waited = time.monotonic() - t0
        self._notify("acquire", {"job": name, "waited_s": waited})
        thaws = [t for _, t in self._since(seq0) if t.action == "thaw" and t.subject == name]
        thaw_s = round(sum(t.seconds for t in thaws), 6)
        return {
            "job": name,
            "waited_s": round(waited, 6),
            "thawed": bool(thaws),
            "thaw_s": thaw_s,
            "restore_s": round(sum(t.phases.get("restore", 0.0) for t in thaws), 6),
            "frozen_bytes": job.frozen_bytes,
            "transitions": self._report(job),
            # the names of 0.1, for clients of that version (one release): "restored" meant thawed
            "restored": bool(thaws), "bytes": job.frozen_bytes,
        }

    def _enqueue(self, name: str) -> asyncio.Future:
        """The job's place in the FIFO queue (a new one at the end): its future is done when it is granted."""
        fut = self.waiters.get(name)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # an attach awaits nothing
            self.waiters[name] = fut
            self.queue.append(name)
            log.info("acquire: job %s queued (position %d)", name, len(self.queue))
            self.wake()
        return fut

    def attach(self, name: str, conn: int | None, *, holding: bool = False, peer_uid: int | None = None) -> dict[str, Any]:
        """A client (back after this agent restarted) says the job is its own, and whether it holds the GPU. A
        holder keeps the GPU however long its step lasts; one this agent no longer counts as holding (its record
        was lost, or the grace ran out) gets the GPU back at once, as if it had asked."""
        job = self.jobs.get(name)
        if job is None and not holding:
            return {"job": name, "attached": False, "holding": False}
        job = self._job(name, conn, peer_uid)
        if holding and not job.holding:
            log.warning("job %s: its client holds the GPU by its own account, this agent did not count it: "
                        "giving the GPU back to it", name)
            self._enqueue(name)
        elif holding:
            log.info("job %s: its client came back and holds the GPU", name)
        self._persist()
        return {"job": name, "attached": True, "holding": job.holding, "queued": name in self.queue}

    def _stop_waiting(self, name: str) -> None:
        """One acquire gave up: the queue entry goes only when no other acquire of the job still waits."""
        left = self._waiting.get(name, 1) - 1
        if left > 0:
            self._waiting[name] = left
            return
        self._drop_waiter(name)

    def _drop_waiter(self, name: str, error: BaseException | None = None) -> None:
        self._waiting.pop(name, None)
        fut = self.waiters.pop(name, None)
        if fut is not None and not fut.done():
            if error is not None:
                fut.set_exception(error)
            else:
                fut.cancel()
        try:
            self.queue.remove(name)
        except ValueError:
            pass
        self.wake()

    async def release(
        self, name: str, conn: int | None, *, wait: bool = False, done: bool = False, swap: str = "checkpoint",
        parked: list[dict[str, int]] | None = None,
    ) -> dict[str, Any]:
        job = self.jobs.get(name)
        if job is None:
            return {"job": name, "released": False, "transitions": []}
        self._job(name, conn)
        if swap != "checkpoint" and not parked and not done:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"swap {swap!r} needs 'parked': what each worker parked and kept")
        self._check_park_reports(parked or [])
        job.swap = swap
        job.parked = {int(r["pid"]): int(r["kept"]) for r in parked or []}
        job.parked_bytes = sum(int(r["parked"]) for r in parked or [])
        was_holding = job.holding
        job.holding = False
        job.ending = job.ending or done
        job.refused = ""  # a new valley: try the freeze again
        job.prepared_until = 0.0
        if name in self.queue:
            self._drop_waiter(name, ProtocolError(ErrorCode.BUSY, f"job {name!r} was released while waiting"))
        if was_holding:
            log.info("release: job %s", name)
        self._persist()
        self.wake()
        if wait:
            await self.settled()
        return {"job": name, "released": was_holding, "transitions": self._report(job)}

    def _check_park_reports(self, parked: list[dict[str, int]]) -> None:
        """A rank can neither have parked nor still keep more than one of the agent's GPUs holds: such a
        figure is refused here, before it can pass a footprint check or block every later thaw."""
        if self.probe is not None:
            gpu, where = self.probe.largest_gpu(), "one of the agent's GPUs holds"
        else:
            gpu, where = MAX_GPU_BYTES, "any GPU holds"
        for r in parked:
            for key in ("parked", "kept"):
                if int(r[key]) > gpu:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"field 'parked': pid {r['pid']} reports {key}="
                                        f"{int(r[key]) / 2**30:.2f} GiB, more than {where} ({gpu / 2**30:.2f} GiB)")

    def prepare(self, name: str, conn: int | None, ttl_s: float | None = None) -> dict[str, Any]:
        job = self._job(name, conn)
        if job.holding:
            return {"job": name, "accepted": False, "reason": "already holding the GPU"}
        job.prepared_until = time.monotonic() + (ttl_s or self.prepare_ttl_s)
        self.wake()
        return {"job": name, "accepted": True, "ttl_s": ttl_s or self.prepare_ttl_s}

    def disconnect(self, conn: int) -> None:
        """A client went away: whatever it held or waited for is released now."""
        self._live_connections.discard(conn)
        self._peers.pop(conn, None)
        for job in self.jobs.values():
            if job.attached != conn:
                continue
            job.attached = None
            job.orphaned_at = time.monotonic()  # no client: a frozen job is thawed after reattach_grace_s
            job.prepared_until = 0.0
            if job.name in self.queue:
                self._drop_waiter(job.name)
            if job.holding:
                job.holding = False
                log.warning("client of job %s disconnected while holding the GPU: releasing it", job.name)
        self._persist()
        self.wake()


    # ================================================================== the reconciler

    def wake(self) -> None:
        self._idle.clear()
        self._wake.set()

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
                    async with self._step_lock:
                        acted = await self._step()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a bug must not kill the agent: log it, fail the waiters
                    log.exception("reconciler step failed")
                    for name in list(self.queue):
                        self._drop_waiter(name, ProtocolError(ErrorCode.INTERNAL, f"agent error: {exc}"))
                    acted = False
                if not acted:
                    break
            if not self._wake.is_set():
                self._idle.set()

    def _world(self) -> World:
        """The policy's view of the jobs, the queue and the tenant."""
        tenant = self.tenant_rec.state if (self.tenant is not None and self.tenant_rec) else ""
        jobs = tuple(
            JobView(name=j.name, state=j.state, holding=j.holding, queued=j.name in self.queue, prepared_until=j.prepared_until,
                    refused=bool(j.refused), ending=j.ending, has_pids=bool(j.pids()))
            for j in self.jobs.values()
        )
        room = self._room_for_tenant() if tenant in (ASLEEP, TENANT_FAULTED) else True
        return World(jobs=jobs, queue_head=self.queue[0] if self.queue else None, tenant=tenant, room_for_tenant=room,
                     now=time.monotonic(), tenant_retry_at=self.tenant_retry_at)

    async def _step(self) -> bool:
        """Make the policy's next move; False when there is none."""
        move = next_move(self._world())
        if move is None:
            return False
        job = self.jobs.get(move.job) if move.job else None
        if move.kind in ("forget", "thaw_ended") and job is not None:
            if move.kind == "thaw_ended":
                try:
                    await self._thaw(job, reason="job ended")  # never leave an ended job's processes frozen
                except ThawError:
                    job.ending = False  # handled like any frozen job: retried on acquire, at shutdown
                    return True
            log.info("job %s ended: forgotten without a freeze", job.name)
            del self.jobs[job.name]
            self._persist()
        elif move.kind == "tenant_yield":
            await self._tenant_yield()
        elif move.kind == "tenant_reclaim":
            await self._tenant_reclaim(check_memory=False)
        elif move.kind == "freeze" and job is not None:
            await self._freeze(job)
        elif move.kind == "thaw" and job is not None:
            await self._thaw_for(job, move.waiting)
        elif move.kind == "recover" and job is not None:
            return await self._recover_faulted(job, move.waiting)
        elif move.kind == "grant" and job is not None:
            self._grant(job)
        else:  # pragma: no cover - the policy names a job that is gone
            return False
        return True

    def _client_pids(self, job: Job | None = None) -> set[int]:
        """Never frozen: the agent itself and every connected client (a trainer driver, say) — except a
        client that registered itself for ``job`` (an SPMD rank is both its job's client and a GPU
        process) where the backend leaves processes running (a stopped client could not ask back)."""
        own = {p.pid for p in job.registered} if job is not None and self.backend.frees_gpu_memory else set()
        return {os.getpid(), *(set(self._peers.values()) - own)}

    def _room_for_tenant(self) -> bool:
        if self.probe is None or not self.tenant_bytes:
            return True
        return self.probe.memory().free >= self.tenant_bytes

    def _grant(self, job: Job) -> None:
        self.queue.popleft()
        job.holding = True
        job.fault = ""
        fut = self.waiters.pop(job.name, None)
        self._waiting.pop(job.name, None)
        if fut is not None and not fut.done():
            fut.set_result(True)
        log.info("grant: job %s owns the GPU", job.name)
        self._persist()
