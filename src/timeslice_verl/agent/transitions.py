"""The arbiter's moves: freeze and thaw a job, yield and reclaim the tenant, each recorded as a transition.

Mixed into :class:`~timeslice_verl.agent.arbiter.Arbiter`, whose state (jobs, tenant, backend, probe) they act on.
A move that fails leaves the job or tenant in a state the policy knows how to continue from.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from timeslice_verl.agent import procfs
from timeslice_verl.agent.ladder import TenantKilled, yield_within
from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.state import FAULTED, FROZEN, RUNNING, TRANSITIONING, Job
from timeslice_verl.agent.tenant import ASLEEP, AWAKE, DEAD, TenantDead, TenantError
from timeslice_verl.agent.freeze.base import FreezeError, ProcState, ThawError
from timeslice_verl.events import Transition
from timeslice_verl.log import get_logger

RESTORE_MEMORY_WAIT_S = 15.0


def _durations(phases: dict[str, float]) -> str:
    """``lock 1.1 ms, checkpoint 1.220 s``: milliseconds under a second, seconds above."""
    return ", ".join(f"{k} {v * 1e3:.1f} ms" if v < 1 else f"{k} {v:.3f} s" for k, v in phases.items())


class ReclaimAbandoned(Exception):
    """A tenant reclaim gave way to a trainer that asked for the GPU."""

RESTORE_MARGIN_BYTES = 256 * 1024**2

log = get_logger("agent")


class TransitionsMixin:
    """Freeze/thaw/tenant moves and their record (the transitions log)."""

    def _record(
        self, action: str, subject: str, start: float, ok: bool, nbytes: int = 0, detail: str = "",
        phases: dict[str, float] | None = None, left: int = 0,
    ) -> Transition:
        t = Transition(
            action=action, subject=subject, start=start, end=time.time(), ok=ok, bytes=nbytes, detail=detail,
            phases={k: round(v, 6) for k, v in (phases or {}).items()}, left=left,
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
        job.busy = True
        try:
            await self._freeze_busy(job)
        finally:
            job.busy = False

    async def _freeze_busy(self, job: Job) -> None:
        pids = await asyncio.to_thread(self.backend.discover, job.name, job.pids(), self._client_pids(job), job.owner_uid)
        if self.jobs.get(job.name) is not job:  # forgotten while the /proc scan ran: touch nothing
            log.info("freeze of job %s dropped: the job was forgotten meanwhile", job.name)
            return
        start = time.time()
        if not pids:  # nothing of this job is on the GPU (yet): nothing to freeze
            job.state, job.frozen_bytes, job.procs = FROZEN, 0, []
            self._record("freeze", job.name, start, True, 0, "no process of the job found")
            self._persist()
            return
        job.state, job.direction = TRANSITIONING, "freeze"
        self.current = f"freeze {job.name}"
        self._persist()
        identities = {p.pid: p.start for p in (procfs.identify(pid) for pid in pids) if p is not None}
        lock_only = job.swap == "park"
        limits = {pid: job.parked.get(pid, 0) + self.park_overhead_bytes for pid in pids} if lock_only else None
        try:
            report = await asyncio.to_thread(self.backend.freeze, pids, identities, lock_only=lock_only, limits=limits)
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
        job.state, job.direction, job.fault = FROZEN, "", ""
        job.frozen_bytes = 0 if lock_only else report.bytes  # a lock moves nothing: a thaw needs no room for it
        job.last_freeze_s = report.total_s
        detail = f"{len(pids)} process(es)" + (f", {report.gb_per_s:.2f} GB/s" if report.gb_per_s else "")
        if job.swap != "checkpoint":
            detail += f", {job.swap}: workers parked {job.parked_bytes / 2**30:.2f} GiB" + (", locked only" if lock_only else "")
        phases = {"lock": report.lock_s, "checkpoint": report.checkpoint_s}
        if report.check_s:
            phases["check"] = report.check_s
        self._record("freeze", job.name, start, True, report.bytes, detail, phases, left=report.residual_bytes)
        shown = {"lock": report.lock_s, "footprint check": report.check_s} if lock_only else phases
        log.info("freeze: job %s pids %s %.2f GiB in %.3f s (%s)", job.name, pids, report.bytes / 2**30, report.total_s,
                 _durations(shown))
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
        if self.probe is not None and self.backend.frees_gpu_memory and (job.frozen_bytes or job.parked_bytes):
            await self._wait_for_room(job)
        job.state, job.direction = TRANSITIONING, "thaw"
        self.current = f"thaw {job.name}"
        self._persist()
        try:
            report = await asyncio.to_thread(self.backend.thaw, pids, self._identities(job))
        except ThawError as exc:
            job.state = FROZEN if exc.still_frozen else FAULTED
            job.direction, job.fault = "", f"restore failed: {exc}"
            self._record("thaw", job.name, start, False, detail=str(exc))
            log.error("thaw of job %s failed (%s): %s", job.name, reason, exc)
            self._persist()
            raise
        finally:
            self.current = ""
        job.state, job.direction, job.fault = RUNNING, "", ""
        job.last_thaw_s = report.total_s
        nbytes = report.bytes or job.frozen_bytes
        detail = f"{len(report.restored)} process(es) restored" + (f", {report.gb_per_s:.2f} GB/s" if report.gb_per_s else "")
        phases = {"restore": report.restore_s, "unlock": report.unlock_s}
        self._record("thaw", job.name, start, True, nbytes, detail, phases)
        shown = phases if report.restored else {"unlock": report.unlock_s}
        log.info("thaw: job %s pids %s in %.3f s (%s)", job.name, pids, report.total_s, _durations(shown))
        self._persist()

    @staticmethod
    def _identities(job: Job) -> dict[int, int]:
        """pid → start time as recorded when the job's processes were frozen or registered."""
        return {p.pid: p.start for p in [*job.registered, *job.procs]}

    async def _wait_for_room(self, job: Job) -> None:
        """A restore that runs out of GPU memory leaves the process stuck: check first."""
        need = job.frozen_bytes + job.parked_bytes + RESTORE_MARGIN_BYTES  # the restore, then the workers' unpark
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

    async def _unless_a_trainer_asks(self, reclaim: Any) -> Any:
        """Run a tenant reclaim, abandoning it the moment a trainer queues: no acquire waits on a reclaim."""
        task = asyncio.ensure_future(reclaim)

        async def trainer_queued() -> None:
            while not self.queue:
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(trainer_queued())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise ReclaimAbandoned(f"tenant reclaim abandoned: job {self.queue[0]!r} asked for the GPU")

    async def _tenant_move(self, action: str, move: Callable[[], Any]) -> float | None:
        """Run a tenant yield/reclaim; on failure record it, mark the tenant dead or faulted, return None."""
        assert self.tenant is not None and self.tenant_rec is not None
        start = time.time()
        self.current = action.replace("_", " ")
        try:
            if action == "tenant_reclaim":
                return await self._unless_a_trainer_asks(move())
            return await move()
        except ReclaimAbandoned as exc:  # the tenant may be half awake: the next step yields it again
            self.tenant_rec.state, self.tenant_rec.error = AWAKE, str(exc)
            self._record(action, self.tenant.url, start, False, detail=str(exc))
            log.info("%s (the valley ended before the tenant was awake)", exc)  # by design: the trainer comes first
            self._persist()
            return None
        except TenantError as exc:
            if isinstance(exc, TenantKilled):
                self._ladder("kill", str(exc))
            dead = isinstance(exc, TenantDead)
            self.tenant_rec.state, self.tenant_rec.error = (DEAD if dead else TENANT_FAULTED), str(exc)
            self._record(action, self.tenant.url, start, False, detail=str(exc))
            self._next_tenant_probe = time.monotonic() + 5.0
            self.tenant_backoff_s = min(30.0, max(0.5, self.tenant_backoff_s * 2))
            log.error("%s failed: %s%s; next try in %.1f s", action, exc, " (the trainer is unaffected)" if dead else "",
                      self.tenant_backoff_s)
            self.tenant_retry_at = time.monotonic() + self.tenant_backoff_s  # no hot loop on a failing tenant
            self._persist()
            return None
        finally:
            self.current = ""

    async def _tenant_yield(self) -> None:
        """Yield the tenant within ``reclaim_deadline_s``, down the ladder if it must (agent/ladder.py)."""
        assert self.tenant is not None and self.tenant_rec is not None
        start = time.time()
        free_before = self.probe.memory().free if self.probe else 0
        climb = await self._tenant_move("tenant_yield", lambda: yield_within(self.tenant, self.reclaim_deadline_s))
        if climb is None:
            return
        if self.probe is not None:
            self.tenant_bytes = max(0, self.probe.memory().free - free_before)
        self.tenant_rec.state, self.tenant_rec.error = ASLEEP, self.tenant.note
        seconds = sum(climb.phases.values())
        detail = climb.detail or f"pause+sleep in {seconds:.3f} s"
        self._record("tenant_yield", self.tenant.url, start, True, self.tenant_bytes, detail, climb.phases)
        if climb.step != "polite":
            self._ladder(climb.step, detail)
        log.info("tenant yield: vLLM paused and asleep in %.3f s%s", seconds, f" ({detail})" if climb.detail else "")
        self._persist()

    def _ladder(self, step: str, detail: str) -> None:
        """A yield went past the polite step: counted, shown by ``status``, sent to the metrics."""
        self.ladder_counts[step] = self.ladder_counts.get(step, 0) + 1
        self.ladder_last = f"{time.strftime('%H:%M:%S')} {step}: {detail}"
        self._notify("ladder", {"step": step, "detail": detail})

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
        self.tenant_rec.state, self.tenant_rec.error = AWAKE, self.tenant.note
        self.tenant_backoff_s = 0.0
        self._record("tenant_reclaim", self.tenant.url, start, True, self.tenant_bytes, f"wake+resume in {seconds:.3f} s")
        log.info("tenant reclaim: vLLM awake and serving in %.3f s", seconds)
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

