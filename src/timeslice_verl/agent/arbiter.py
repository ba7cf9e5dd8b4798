"""Who owns the GPU, and the single worker that moves it there.

Rules (docs/architecture.md §5):

* a trainer job that asks (``acquire``) gets the GPU before the tenant; several jobs queue FIFO;
* the tenant (vLLM) holds the GPU whenever no trainer job holds, waits for or has prepared it;
* exactly one transition at a time: a single reconciler task computes the desired owner and
  performs the next move (tenant yield, freeze of another job, thaw, grant, tenant reclaim),
  re-reading the situation after each one, so requests that arrive mid-transition are honoured
  at the next step instead of racing it;
* a job whose client disconnects, or whose processes die, stops holding at once (the reconciler
  then parks it and wakes the tenant); a tenant that stops answering is marked dead and ignored.

Every change is persisted through :class:`~timeslice_verl.agent.state.StateStore`; on start the
arbiter reconciles the recorded jobs with what the driver reports before it serves anyone.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any, Callable

from timeslice_verl.agent import procfs
from timeslice_verl.agent.gpu import NvmlProbe
from timeslice_verl.agent.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.state import FAULTED, RUNNING, SAVED, TRANSITIONING, Job, StateStore, TenantRecord
from timeslice_verl.agent.tenant import ASLEEP, AWAKE, DEAD, TenantDead, TenantError, VllmTenant
from timeslice_verl.agent.trainer.base import FreezeError, ProcState, ThawError, TrainerBackend
from timeslice_verl.events import Transition
from timeslice_verl.log import get_logger

log = get_logger("agent")

TENANT_FAULTED = "faulted"
RESTORE_MEMORY_WAIT_S = 15.0
RESTORE_MARGIN_BYTES = 256 * 1024**2


class Arbiter:
    def __init__(
        self,
        backend: TrainerBackend,
        store: StateStore,
        *,
        probe: NvmlProbe | None = None,
        tenant_request_timeout_s: float = 30.0,
        tenant_drain_timeout_s: float = 600.0,
        tenant_pause_mode: str = "wait",
        prepare_ttl_s: float = 60.0,
        watch_interval_s: float = 0.2,
    ) -> None:
        self.backend = backend
        self.store = store
        self.probe = probe
        self.tenant_request_timeout_s = tenant_request_timeout_s
        self.tenant_drain_timeout_s = tenant_drain_timeout_s
        self.tenant_pause_mode = tenant_pause_mode
        self.prepare_ttl_s = prepare_ttl_s
        self.watch_interval_s = watch_interval_s
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.waiters: dict[str, asyncio.Future] = {}
        self.tenant: VllmTenant | None = None
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
        self._peers: dict[int, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._live_connections: set[int] = set()
        self._next_tenant_probe = 0.0
        self.started = time.time()

    # ================================================================== lifecycle

    async def start(self, tenant_url: str = "", sleep_level: int = 1) -> None:
        """Reconcile the persisted state with reality, then start the reconciler and the watchdog."""
        jobs, tenant_rec, _ = self.store.load()
        for job in jobs.values():
            await self._reconcile_job(job)
        self.jobs = {name: job for name, job in jobs.items() if job.procs or job.registered or job.holding}
        url, level = tenant_url, sleep_level
        if tenant_rec and tenant_rec.url.rstrip("/") != tenant_url.rstrip("/"):
            if tenant_url:  # the configured tenant replaces the recorded one: never leave that one asleep
                await self._wake_forgotten(tenant_rec)
            else:
                url, level = tenant_rec.url, tenant_rec.sleep_level
        if url:
            try:
                await self.register_tenant(url, level, persist=False)
            except (TenantError, ProtocolError) as exc:
                log.error("tenant %s: %s (will retry)", url, exc)
                self.tenant = self._make_tenant(url, level)
                self.tenant_rec = TenantRecord(url=url, state=DEAD, sleep_level=level, error=str(exc))
        self._persist()
        self._tasks = [asyncio.create_task(self._reconciler(), name="reconciler"), asyncio.create_task(self._watchdog(), name="watchdog")]
        self.wake()

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

    async def _reconcile_job(self, job: Job) -> None:
        before = (job.state, [p.pid for p in job.procs])
        job.procs = [p for p in job.procs if procfs.alive(p)]
        job.registered = [p for p in job.registered if procfs.alive(p)]
        pids = job.pids()
        job.direction = ""
        if not pids:
            job.state, job.saved_bytes = RUNNING, 0
            log.info("restart: job %s has no live process any more (was %s %s)", job.name, *before)
            return
        states = await asyncio.to_thread(self.backend.states, pids)
        values = set(states.values()) - {ProcState.GONE}
        if values == {ProcState.CHECKPOINTED}:
            job.state = SAVED
        elif values <= {ProcState.RUNNING}:
            job.state = RUNNING
        elif ProcState.FAILED in values:
            job.state, job.fault = FAULTED, f"driver reports FAILED for pid(s) {[p for p, s in states.items() if s == ProcState.FAILED]}"
        else:  # interrupted mid-transition: bring the job back to running, consistently
            try:
                await asyncio.to_thread(self.backend.thaw, pids, self._identities(job))
                job.state = RUNNING
            except ThawError as exc:
                job.state = SAVED if exc.still_frozen else FAULTED
                job.fault = f"restart recovery: {exc}"
        log.info("restart: job %s was %s, processes %s are %s -> %s", job.name, before[0], pids,
                 sorted({s.value for s in states.values()}), job.state)

    async def shutdown(self) -> None:
        """Stop serving; thaw every frozen job and wake the tenant, so nothing is left parked."""
        self.shutting_down = True
        for _name, fut in list(self.waiters.items()):
            if not fut.done():
                fut.set_exception(ProtocolError(ErrorCode.SHUTTING_DOWN, "the agent is shutting down"))
        self.queue.clear()
        self.waiters.clear()
        await self._step_lock.acquire()  # let a transition in progress finish, start no new one
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for job in list(self.jobs.values()):
            if job.state in (SAVED, FAULTED, TRANSITIONING) and job.pids():
                try:
                    await self._thaw(job, reason="agent shutdown")
                except Exception as exc:
                    log.error("shutdown: job %s could not be thawed: %s", job.name, exc)
        if self.tenant is not None and self.tenant_rec and self.tenant_rec.state in (ASLEEP, TENANT_FAULTED):
            try:
                await self._tenant_reclaim(check_memory=True)
            except Exception as exc:
                log.error("shutdown: tenant could not be woken: %s", exc)
        self._persist()
        if self.tenant is not None:
            await self.tenant.close()
        self.backend.close()
        self._step_lock.release()

    # ================================================================== requests

    def connection_opened(self, conn: int, peer_pid: int | None = None) -> None:
        self._live_connections.add(conn)
        if peer_pid:
            self._peers[conn] = peer_pid

    def _job(self, name: str, conn: int | None) -> Job:
        if self.shutting_down:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the agent is shutting down")
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = Job(name=name, cursor=self.seq)
        if conn is not None:
            if job.attached not in (None, conn) and job.attached in self._live_connections:
                raise ProtocolError(ErrorCode.BUSY, f"job {name!r} is in use by another client of this agent")
            job.attached = conn
        return job

    def register_pids(self, name: str, pids: list[int], conn: int | None, peer_uid: int | None) -> dict[str, Any]:
        job = self._job(name, conn)
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
        job = self._job(name, conn)
        if pids:
            self.register_pids(name, pids, conn, peer_uid)
        t0 = time.monotonic()
        seq0 = self.seq
        if not job.holding:
            fut = self.waiters.get(name)
            if fut is None:
                fut = asyncio.get_running_loop().create_future()
                self.waiters[name] = fut
                self.queue.append(name)
                log.info("acquire: job %s queued (position %d)", name, len(self.queue))
                self.wake()
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout=timeout_s or None)
            except asyncio.TimeoutError:
                self._drop_waiter(name)
                raise ProtocolError(ErrorCode.TIMEOUT, f"job {name!r} did not get the GPU within {timeout_s:g} s") from None
            except asyncio.CancelledError:
                self._drop_waiter(name)
                raise
        waited = time.monotonic() - t0
        self._notify("acquire", {"job": name, "waited_s": waited})
        restore = [t for _, t in self._since(seq0) if t.action == "thaw" and t.subject == name]
        return {
            "job": name,
            "waited_s": round(waited, 6),
            "restored": bool(restore),
            "restore_s": round(sum(t.seconds for t in restore), 6),
            "bytes": job.saved_bytes,
            "transitions": self._report(job),
        }

    def _drop_waiter(self, name: str, error: BaseException | None = None) -> None:
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

    async def release(self, name: str, conn: int | None, *, wait: bool = False, done: bool = False) -> dict[str, Any]:
        job = self.jobs.get(name)
        if job is None:
            return {"job": name, "released": False, "transitions": []}
        self._job(name, conn)
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
            job.prepared_until = 0.0
            if job.name in self.queue:
                self._drop_waiter(job.name)
            if job.holding:
                job.holding = False
                log.warning("client of job %s disconnected while holding the GPU: releasing it", job.name)
        self._persist()
        self.wake()

    async def register_tenant(self, url: str, sleep_level: int = 1, *, persist: bool = True) -> dict[str, Any]:
        if self.tenant is not None and self.tenant.url != url.rstrip("/"):
            raise ProtocolError(ErrorCode.BUSY, f"a tenant is already registered ({self.tenant.url}); unregister it first")
        tenant = self.tenant or self._make_tenant(url, sleep_level)
        try:
            info = await tenant.register()
        except TenantError as exc:
            if self.tenant is None:
                await tenant.close()
            raise ProtocolError(ErrorCode.TENANT, str(exc)) from None
        self.tenant = tenant
        self.tenant_rec = TenantRecord(url=tenant.url, state=tenant.state, version=info.version, sleep_level=sleep_level)
        if persist:
            self._persist()
        self.wake()
        return self.tenant_rec.to_dict()

    def _make_tenant(self, url: str, sleep_level: int) -> VllmTenant:
        return VllmTenant(
            url, sleep_level=sleep_level, request_timeout_s=self.tenant_request_timeout_s,
            drain_timeout_s=self.tenant_drain_timeout_s, pause_mode=self.tenant_pause_mode,
        )

    async def unregister_tenant(self) -> dict[str, Any]:
        """Forget the tenant, waking it first (it is never left asleep)."""
        if self.tenant is None:
            return {"unregistered": False}
        async with self._step_lock:  # no transition runs meanwhile
            if self.tenant_rec and self.tenant_rec.state in (ASLEEP, TENANT_FAULTED):
                try:
                    await self._tenant_reclaim(check_memory=False)
                except Exception as exc:
                    log.error("unregister: tenant could not be woken: %s", exc)
            url = self.tenant.url
            await self.tenant.close()
            self.tenant, self.tenant_rec = None, None
            self._persist()
        return {"unregistered": True, "url": url}

    # ================================================================== the reconciler

    def wake(self) -> None:
        self._idle.clear()
        self._wake.set()

    async def settled(self, timeout_s: float = 600.0) -> None:
        """Wait until the reconciler has nothing left to do."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)

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

    def _desired(self) -> Job | None:
        """The job that should own the GPU now, or None for the tenant."""
        for job in self.jobs.values():
            if job.holding:
                return job
        if self.queue:
            return self.jobs[self.queue[0]]
        now = time.monotonic()
        prepared = [j for j in self.jobs.values() if j.prepared_until > now]
        return min(prepared, key=lambda j: j.prepared_until) if prepared else None

    async def _step(self) -> bool:
        for job in list(self.jobs.values()):
            if job.ending and not job.holding and job.name not in self.queue:
                if job.state in (SAVED, FAULTED) and job.pids():
                    try:
                        await self._thaw(job, reason="job ended")  # never leave an ended job's processes frozen
                    except ThawError:
                        job.ending = False  # handled like any frozen job: retried on acquire, at shutdown
                        return True
                log.info("job %s ended: forgotten without a freeze", job.name)
                del self.jobs[job.name]
                self._persist()
                return True
        target = self._desired()
        tenant_state = self.tenant_rec.state if (self.tenant is not None and self.tenant_rec) else ""
        if target is not None:
            if tenant_state == AWAKE:
                await self._tenant_yield()
                return True
            for other in self.jobs.values():
                if other is not target and other.state == RUNNING and not other.holding and not other.refused:
                    await self._freeze(other)
                    return True
            waiting = bool(self.queue) and self.queue[0] == target.name
            if target.state == SAVED:
                await self._thaw_for(target, waiting)
                return True
            if target.state == FAULTED:
                return await self._recover_faulted(target, waiting)
            if target.state == RUNNING and waiting:
                self._grant(target)
                return True
            return False
        for job in self.jobs.values():
            if job.state == RUNNING and not job.holding and not job.refused:
                await self._freeze(job)
                return True
        if any(job.refused and job.state == RUNNING for job in self.jobs.values()):
            return False  # a job that could not be frozen is still on the GPU: the tenant sleeps on
        if tenant_state in (ASLEEP, TENANT_FAULTED) and self._room_for_tenant():
            await self._tenant_reclaim(check_memory=False)
            return True
        return False

    def _client_pids(self) -> set[int]:
        """Never frozen: the agent itself and every connected client (a trainer driver, say)."""
        return {os.getpid(), *self._peers.values()}

    def _room_for_tenant(self) -> bool:
        if self.probe is None or not self.tenant_bytes:
            return True
        return self.probe.memory().free >= self.tenant_bytes

    def _grant(self, job: Job) -> None:
        self.queue.popleft()
        job.holding = True
        job.fault = ""
        fut = self.waiters.pop(job.name, None)
        if fut is not None and not fut.done():
            fut.set_result(True)
        log.info("grant: job %s owns the GPU", job.name)
        self._persist()

    async def _recover_faulted(self, job: Job, waiting: bool) -> bool:
        states = await asyncio.to_thread(self.backend.states, job.pids())
        live = {s for s in states.values() if s != ProcState.GONE}
        if live <= {ProcState.RUNNING}:
            job.state = RUNNING  # a failed freeze was unwound: its processes are on the GPU
            log.info("job %s recovers from fault %r: its processes are running", job.name, job.fault)
            self._persist()
            return True
        if waiting:
            await self._thaw_for(job, waiting)
            return True
        return False

    # ================================================================== transitions

    def _record(
        self, action: str, subject: str, start: float, ok: bool, nbytes: int = 0, detail: str = "", phases: dict[str, float] | None = None
    ) -> Transition:
        t = Transition(
            action=action, subject=subject, start=start, end=time.time(), ok=ok, bytes=nbytes, detail=detail,
            phases={k: round(v, 6) for k, v in (phases or {}).items()},
        )
        self.seq += 1
        self.transitions.append((self.seq, t))
        self._notify("transition", t.to_dict())
        return t

    def _since(self, seq: int) -> list[tuple[int, Transition]]:
        return [(s, t) for s, t in self.transitions if s > seq]

    def _report(self, job: Job) -> list[dict[str, Any]]:
        out = [t.to_dict() for _, t in self._since(job.cursor)]
        job.cursor = self.seq
        return out

    def _notify(self, kind: str, data: dict[str, Any]) -> None:
        for listener in self.listeners:
            try:
                listener(kind, data)
            except Exception:  # pragma: no cover - a metrics bug must not stop the agent
                log.exception("listener failed")

    async def _freeze(self, job: Job) -> None:
        pids = await asyncio.to_thread(self.backend.discover, job.name, job.pids(), self._client_pids())
        start = time.time()
        if not pids:  # nothing of this job is on the GPU (yet): nothing to park
            job.state, job.saved_bytes, job.procs = SAVED, 0, []
            self._record("freeze", job.name, start, True, 0, "no process of the job found")
            self._persist()
            return
        job.state, job.direction = TRANSITIONING, "freeze"
        self.current = f"freeze {job.name}"
        self._persist()
        identities = {p.pid: p.start for p in (procfs.identify(pid) for pid in pids) if p is not None}
        try:
            report = await asyncio.to_thread(self.backend.freeze, pids, identities)
        except FreezeError as exc:
            if exc.refused:  # nothing was touched: the job keeps the GPU for this valley, the tenant sleeps on
                job.state, job.direction, job.refused = RUNNING, "", str(exc)
                self._record("freeze", job.name, start, False, detail=str(exc))
                log.error("freeze of job %s refused: %s (the job keeps the GPU; the tenant stays asleep)", job.name, exc)
                self._persist()
                return
            job.state, job.direction, job.fault = FAULTED, "", f"freeze failed: {exc}"
            self._record("freeze", job.name, start, False, detail=str(exc))
            log.error("freeze of job %s failed: %s", job.name, exc)
            self._persist()
            return
        finally:
            self.current = ""
        job.procs = [p for p in (procfs.identify(pid) for pid in pids) if p is not None]
        job.state, job.direction, job.saved_bytes, job.fault = SAVED, "", report.bytes, ""
        job.last_freeze_s = report.total_s
        detail = f"{len(pids)} process(es)" + (f", {report.gb_per_s:.2f} GB/s" if report.gb_per_s else "")
        phases = {"lock": report.lock_s, "checkpoint": report.checkpoint_s}
        self._record("freeze", job.name, start, True, report.bytes, detail, phases)
        log.info(
            "freeze: job %s pids %s %.2f GiB in %.3f s (lock %.1f ms, checkpoint %.3f s)",
            job.name, pids, report.bytes / 2**30, report.total_s, report.lock_s * 1e3, report.checkpoint_s,
        )
        self._persist()

    async def _thaw_for(self, job: Job, waiting: bool) -> None:
        try:
            await self._thaw(job, reason="grant")
        except ThawError as exc:
            if waiting:
                self._drop_waiter(job.name, ProtocolError(ErrorCode.FAULT, f"restore of job {job.name!r} failed: {exc}"))
            else:
                job.prepared_until = 0.0

    async def _thaw(self, job: Job, reason: str) -> None:
        pids = job.pids()
        start = time.time()
        if self.probe is not None and self.backend.frees_gpu_memory and job.saved_bytes:
            await self._wait_for_room(job)
        job.state, job.direction = TRANSITIONING, "thaw"
        self.current = f"thaw {job.name}"
        self._persist()
        try:
            report = await asyncio.to_thread(self.backend.thaw, pids, self._identities(job))
        except ThawError as exc:
            job.state = SAVED if exc.still_frozen else FAULTED
            job.direction, job.fault = "", f"restore failed: {exc}"
            self._record("thaw", job.name, start, False, detail=str(exc))
            log.error("thaw of job %s failed (%s): %s", job.name, reason, exc)
            self._persist()
            raise
        finally:
            self.current = ""
        job.state, job.direction, job.fault = RUNNING, "", ""
        job.last_restore_s = report.total_s
        nbytes = report.bytes or job.saved_bytes
        detail = f"{len(report.restored)} process(es) restored" + (f", {report.gb_per_s:.2f} GB/s" if report.gb_per_s else "")
        phases = {"restore": report.restore_s, "unlock": report.unlock_s}
        self._record("thaw", job.name, start, True, nbytes, detail, phases)
        log.info("thaw: job %s pids %s in %.3f s (restore %.3f s, unlock %.1f ms)", job.name, pids, report.total_s,
                 report.restore_s, report.unlock_s * 1e3)
        self._persist()

    @staticmethod
    def _identities(job: Job) -> dict[int, int]:
        """pid → start time as recorded when the job's processes were frozen or registered."""
        return {p.pid: p.start for p in [*job.registered, *job.procs]}

    async def _wait_for_room(self, job: Job) -> None:
        """A restore that runs out of GPU memory leaves the process stuck: check first."""
        need = job.saved_bytes + RESTORE_MARGIN_BYTES
        deadline = time.monotonic() + RESTORE_MEMORY_WAIT_S
        while True:
            free = self.probe.memory().free  # type: ignore[union-attr]
            if free >= need:
                return
            if time.monotonic() > deadline:
                users = self.probe.process_memory()  # type: ignore[union-attr]
                raise ThawError(
                    f"not enough free GPU memory to restore job {job.name!r}: needs {need / 2**30:.2f} GiB, "
                    f"{free / 2**30:.2f} GiB free (GPU processes: {users})",
                    still_frozen=True,
                )
            await asyncio.sleep(0.1)

    async def _tenant_move(self, action: str, move: Callable[[], Any]) -> float | None:
        """Run a tenant yield/reclaim; on failure record it, mark the tenant dead or faulted, return None."""
        assert self.tenant is not None and self.tenant_rec is not None
        start = time.time()
        self.current = action.replace("_", " ")
        try:
            return await move()
        except TenantError as exc:
            dead = isinstance(exc, TenantDead)
            self.tenant_rec.state, self.tenant_rec.error = (DEAD if dead else TENANT_FAULTED), str(exc)
            self._record(action, self.tenant.url, start, False, detail=str(exc))
            log.error("%s failed: %s%s", action, exc, " (the trainer is unaffected)" if dead else "")
            self._next_tenant_probe = time.monotonic() + 5.0
            self._persist()
            return None
        finally:
            self.current = ""

    async def _tenant_yield(self) -> None:
        assert self.tenant is not None and self.tenant_rec is not None
        start = time.time()
        free_before = self.probe.memory().free if self.probe else 0
        seconds = await self._tenant_move("tenant_yield", self.tenant.yield_gpu)
        if seconds is None:
            return
        if self.probe is not None:
            self.tenant_bytes = max(0, self.probe.memory().free - free_before)
        self.tenant_rec.state, self.tenant_rec.error = ASLEEP, ""
        self._record("tenant_yield", self.tenant.url, start, True, self.tenant_bytes, f"pause+sleep in {seconds:.3f} s")
        log.info("tenant yield: vLLM paused and asleep in %.3f s", seconds)
        self._persist()

    async def _tenant_reclaim(self, *, check_memory: bool) -> None:
        assert self.tenant is not None and self.tenant_rec is not None
        if check_memory and not self._room_for_tenant():
            free = self.probe.memory().free if self.probe else 0
            log.warning("not waking vLLM: %.2f GiB free, it needs %.2f GiB", free / 2**30, self.tenant_bytes / 2**30)
            return
        start = time.time()
        seconds = await self._tenant_move("tenant_reclaim", self.tenant.reclaim)
        if seconds is None:
            return
        self.tenant_rec.state, self.tenant_rec.error = AWAKE, ""
        self._record("tenant_reclaim", self.tenant.url, start, True, self.tenant_bytes, f"wake+resume in {seconds:.3f} s")
        log.info("tenant reclaim: vLLM awake and serving in %.3f s", seconds)
        self._persist()

    # ================================================================== watchdog

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
            if job.prepared_until and job.prepared_until <= now:
                job.prepared_until = 0.0
                changed = True
            known = job.procs + job.registered
            if not known:
                if job.attached is None and not job.holding and name not in self.queue and job.state in (RUNNING, SAVED):
                    del self.jobs[name]
                    changed = True
                continue
            live_procs = [p for p in job.procs if procfs.alive(p)]
            live_reg = [p for p in job.registered if procfs.alive(p)]
            if len(live_procs) + len(live_reg) == len(known):
                continue
            job.procs, job.registered = live_procs, live_reg
            changed = True
            if not job.pids() and job.state != TRANSITIONING:
                log.warning("job %s: all its processes exited%s", name, " while holding the GPU: releasing" if job.holding else "")
                job.holding = False
                job.state, job.saved_bytes = RUNNING, 0
                if job.attached is None and name not in self.queue:
                    del self.jobs[name]
        if self.tenant is not None and self.tenant_rec and self.tenant_rec.state in (DEAD, TENANT_FAULTED) and now >= self._next_tenant_probe:
            self._next_tenant_probe = now + 5.0
            if await self.tenant.alive():
                try:
                    info = await self.tenant.register()
                    self.tenant_rec.state, self.tenant_rec.version, self.tenant_rec.error = self.tenant.state, info.version, ""
                    log.info("tenant %s answers again (%s)", self.tenant.url, self.tenant.state)
                    changed = True
                except TenantError as exc:
                    self.tenant_rec.error = str(exc)
        if changed:
            self._persist()
            self.wake()

    # ================================================================== status / persistence

    def owner(self) -> str:
        for job in self.jobs.values():
            if job.holding and job.state == RUNNING:
                return f"job:{job.name}"
        if self.tenant_rec and self.tenant_rec.state == AWAKE:
            return "tenant"
        if self.current:
            return "transitioning"
        for job in self.jobs.values():
            if job.state == RUNNING and job.pids():
                return f"job:{job.name}"
        return "none"

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        jobs = []
        for job in self.jobs.values():
            d = job.to_dict()
            d["pids"] = job.pids()
            d["attached"] = job.attached is not None
            d["prepared"] = job.prepared_until > now
            d["queued"] = job.name in self.queue
            d["refused"] = job.refused
            del d["procs"], d["registered"]
            jobs.append(d)
        snap: dict[str, Any] = {
            "owner": self.owner(),
            "transition": self.current,
            "queue": list(self.queue),
            "jobs": jobs,
            "tenant": self.tenant_rec.to_dict() if self.tenant_rec else None,
            "transitions": self.seq,
        }
        if self.probe is not None:
            mem = self.probe.memory()
            snap["gpu"] = {"total": mem.total, "used": mem.used, "free": mem.free, "driver": self.probe.driver_version}
        return snap

    def _persist(self) -> None:
        try:
            self.store.save(self.jobs, self.tenant_rec, {"queue": list(self.queue)})
        except OSError as exc:  # pragma: no cover - disk full etc.
            log.error("could not write state file %s: %s", self.store.path, exc)

