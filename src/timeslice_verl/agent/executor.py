"""The executor: freezes and thaws a job's processes through the freeze backend, each move journalled.

A move that fails leaves the job in a state the policy knows how to continue from: a refused freeze (nothing
touched) keeps the job RUNNING with the GPU, a failed one FAULTED, a failed thaw FROZEN (or FAULTED when the
processes are in between). ``park`` and ``resident`` releases are locked only (the ranks moved or keep their
own tensors), with the footprint check that the agent lends no more than the ranks left.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from timeslice_verl.agent import procfs
from timeslice_verl.agent.freeze.base import FreezeBackend, FreezeError, ProcState, ThawError
from timeslice_verl.agent.gpu import NvmlProbe
from timeslice_verl.agent.journal import Journal
from timeslice_verl.agent.state import FAULTED, FROZEN, RUNNING, TRANSITIONING, Job
from timeslice_verl.log import get_logger
from timeslice_verl.names import SwapMode

log = get_logger("agent")

RESTORE_MEMORY_WAIT_S = 15.0
RESTORE_MARGIN_BYTES = 256 * 1024**2
"""Swaps after which the agent only locks the processes: their tensors were parked by the ranks, or stay."""


def durations(phases: dict[str, float]) -> str:
    """``lock 1.1 ms, checkpoint 1.220 s``: milliseconds under a second, seconds above."""
    return ", ".join(f"{k} {v * 1e3:.1f} ms" if v < 1 else f"{k} {v:.3f} s" for k, v in phases.items())


class Executor:
    def __init__(self, backend: FreezeBackend, journal: Journal, *, probe: NvmlProbe | None, park_overhead_bytes: int,
                 persist: Callable[[], None], still_known: Callable[[Job], bool],
                 client_pids: Callable[[Job], set[int]]) -> None:
        self.backend, self.journal, self.probe = backend, journal, probe
        self.park_overhead_bytes = park_overhead_bytes
        self.persist, self.still_known, self.client_pids = persist, still_known, client_pids
        self.current = ""
        """The move under way (``freeze job-a``), for the status."""

    async def freeze(self, job: Job) -> None:
        job.busy = True
        try:
            await self._freeze(job)
        finally:
            job.busy = False

    async def _freeze(self, job: Job) -> None:
        ranks = [p.pid for p in job.registered]  # not job.procs: what a tag found last time is no rank
        pids = await asyncio.to_thread(self.backend.discover, job.name, ranks, self.client_pids(job), job.owner_uid)
        if not self.still_known(job) or job.ending or job.holding:  # forgotten, ended or back during the scan
            log.info("freeze of job %s dropped: the job %s meanwhile", job.name,
                     "was forgotten" if not self.still_known(job) else "ended" if job.ending else "asked again")
            return
        start = time.time()
        if not pids:  # nothing of this job is on the GPU (yet): nothing to freeze
            job.state, job.frozen_bytes, job.procs = FROZEN, 0, []
            self.journal.record("freeze", job.name, start, True, 0, "no process of the job found")
            self.persist()
            return
        job.state, job.direction = TRANSITIONING, "freeze"
        self.current = f"freeze {job.name}"
        self.persist()
        identities = {p.pid: p.start for p in (procfs.identify(pid) for pid in pids) if p is not None}
        mode = SwapMode(job.swap)
        lock_only = mode.locks_only
        limits = {pid: job.parked.get(pid, 0) + self.park_overhead_bytes for pid in pids} if lock_only else None
        try:
            report = await asyncio.to_thread(self.backend.freeze, pids, identities, lock_only=lock_only, limits=limits)
        except FreezeError as exc:
            self._failed_freeze(job, start, exc)
            return
        finally:
            self.current = ""
        job.procs = [p for p in (procfs.identify(pid) for pid in pids) if p is not None]
        job.state, job.direction, job.fault = FROZEN, "", ""
        job.frozen_bytes = 0 if lock_only else report.bytes  # a lock moves nothing: a thaw needs no room for it
        job.last_freeze_s = report.total_s
        detail = f"{len(pids)} process(es)" + (f", {report.gb_per_s:.2f} GB/s" if report.gb_per_s else "")
        if mode is SwapMode.resident:
            detail += ", resident: the tensors stay on the GPU, locked only"
        elif mode is not SwapMode.checkpoint:
            detail += f", {job.swap}: workers parked {job.parked_bytes / 2**30:.2f} GiB" + (", locked only" if lock_only else "")
        phases = {"lock": report.lock_s, "checkpoint": report.checkpoint_s}
        if report.check_s:
            phases["check"] = report.check_s
        self.journal.record("freeze", job.name, start, True, report.bytes, detail, phases, left=report.residual_bytes)
        shown = {"lock": report.lock_s, "footprint check": report.check_s} if lock_only else phases
        log.info("freeze: job %s pids %s %.2f GiB in %.3f s (%s)", job.name, pids, report.bytes / 2**30, report.total_s,
                 durations(shown))
        self.persist()

    def _failed_freeze(self, job: Job, start: float, exc: FreezeError) -> None:
        self.journal.record("freeze", job.name, start, False, detail=str(exc))
        if exc.refused:  # nothing was touched: the job keeps the GPU for this valley, the tenant sleeps on
            job.state, job.direction, job.refused = RUNNING, "", str(exc)
            log.error("freeze of job %s refused: %s (the job keeps the GPU; the tenant stays asleep)", job.name, exc)
        else:
            job.state, job.direction, job.fault = FAULTED, "", f"freeze failed: {exc}"
            log.error("freeze of job %s failed: %s", job.name, exc)
        self.persist()

    async def thaw(self, job: Job, reason: str) -> None:
        pids = job.pids()
        start = time.time()
        if self.probe is not None and self.backend.frees_gpu_memory and (job.frozen_bytes or job.parked_bytes):
            await self._wait_for_room(job)
        job.state, job.direction = TRANSITIONING, "thaw"
        self.current = f"thaw {job.name}"
        self.persist()
        try:
            report = await asyncio.to_thread(self.backend.thaw, pids, identities(job))
        except ThawError as exc:
            job.state = FROZEN if exc.still_frozen else FAULTED
            job.direction, job.fault = "", f"restore failed: {exc}"
            self.journal.record("thaw", job.name, start, False, detail=str(exc))
            log.error("thaw of job %s failed (%s): %s", job.name, reason, exc)
            self.persist()
            raise
        finally:
            self.current = ""
        job.state, job.direction, job.fault = RUNNING, "", ""
        job.last_thaw_s = report.total_s
        nbytes = report.bytes or job.frozen_bytes
        detail = f"{len(report.restored)} process(es) restored" + (f", {report.gb_per_s:.2f} GB/s" if report.gb_per_s else "")
        phases = {"restore": report.restore_s, "unlock": report.unlock_s}
        self.journal.record("thaw", job.name, start, True, nbytes, detail, phases)
        shown = phases if report.restored else {"unlock": report.unlock_s}
        log.info("thaw: job %s pids %s in %.3f s (%s)", job.name, pids, report.total_s, durations(shown))
        self.persist()

    async def _wait_for_room(self, job: Job) -> None:
        """A restore that runs out of GPU memory leaves the process stuck: check first."""
        need = job.frozen_bytes + job.parked_bytes + RESTORE_MARGIN_BYTES  # the restore, then the workers' unpark
        deadline = time.monotonic() + RESTORE_MEMORY_WAIT_S
        assert self.probe is not None
        while True:
            free = self.probe.memory().free
            if free >= need:
                return
            if time.monotonic() > deadline:
                raise ThawError(f"not enough free GPU memory to restore job {job.name!r}: needs {need / 2**30:.2f} GiB, "
                                f"{free / 2**30:.2f} GiB free (GPU processes: {self.probe.process_memory()})",
                                still_frozen=True)
            await asyncio.sleep(0.1)

    async def running_again(self, job: Job) -> bool:
        """A faulted job whose processes all run (a failed freeze was unwound) is RUNNING again."""
        states = await asyncio.to_thread(self.backend.states, job.pids())
        live = {s for s in states.values() if s != ProcState.GONE}
        if live <= {ProcState.RUNNING}:
            job.state = RUNNING
            log.info("job %s recovers from fault %r: its processes are running", job.name, job.fault)
            self.persist()
            return True
        return False

    def gpus_of(self, job: Job) -> list[int]:
        """The agent's GPU indices (NVML) the job's processes use (what a tenant supervisor starts vLLM on)."""
        if self.probe is None:
            return []
        return self.probe.gpus_of(job.pids())


def identities(job: Job) -> dict[int, int]:
    """pid → start time as recorded when the job's processes were frozen or registered."""
    return {p.pid: p.start for p in [*job.registered, *job.procs]}


__all__ = ["Executor", "durations", "identities"]
