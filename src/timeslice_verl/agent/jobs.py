"""The agent's job book: the jobs it knows, the FIFO queue of those that asked for the GPU, their clients.

Requests only change what is recorded here (who asked, who holds, whose client is gone); the reconciler
(:mod:`~timeslice_verl.agent.arbiter`) reads it and makes the moves.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any, Callable

from timeslice_verl.agent import procfs
from timeslice_verl.agent.client.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.state import Job
from timeslice_verl.log import get_logger

log = get_logger("agent")

MAX_JOBS_PER_CLIENT = 16
"""Job names one connection may create (a trainer uses one): thousands of idle names would each cost a /proc scan."""
MAX_JOBS = 256


class JobBook:
    def __init__(self, *, wake: Callable[[], None], persist: Callable[[], None], seq: Callable[[], int]) -> None:
        self.wake, self.persist, self.seq = wake, persist, seq
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.waiters: dict[str, asyncio.Future] = {}
        self.peers: dict[int, int] = {}
        """connection → the client's pid."""
        self.live: set[int] = set()
        """Open connections."""
        self.closed = False
        """The agent is shutting down: no new job."""
        self._waiting: dict[str, int] = {}

    # ------------------------------------------------------------------ jobs and their clients

    def job(self, name: str, conn: int | None, peer_uid: int | None = None) -> Job:
        """The job ``name`` (created on first use), attached to connection ``conn``."""
        if self.closed:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the agent is shutting down")
        job = self.jobs.get(name)
        if job is None:
            mine = sum(1 for j in self.jobs.values() if conn is not None and j.attached == conn)
            if mine >= MAX_JOBS_PER_CLIENT or len(self.jobs) >= MAX_JOBS:
                raise ProtocolError(ErrorCode.BUSY, f"too many jobs ({mine} of this client, {len(self.jobs)} in all; the limits "
                                    f"are {MAX_JOBS_PER_CLIENT} and {MAX_JOBS}): one trainer needs one job name")
            job = self.jobs[name] = Job(name=name, cursor=self.seq())  # its client hears of moves from now on
        if conn is not None:
            if job.attached not in (None, conn) and job.attached in self.live:
                raise ProtocolError(ErrorCode.BUSY, f"job {name!r} is in use by another client of this agent")
            job.attached = conn
            job.orphaned_at = 0.0  # its client is back
        if peer_uid is not None and job.owner_uid is None:
            job.owner_uid = peer_uid
        return job

    def register_pids(self, name: str, pids: list[int], conn: int | None, peer_uid: int | None) -> Job:
        job = self.job(name, conn, peer_uid)
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
        self.persist()
        return job

    def opened(self, conn: int, peer_pid: int | None = None) -> None:
        self.live.add(conn)
        if peer_pid:
            self.peers[conn] = peer_pid

    def disconnect(self, conn: int) -> None:
        """A client went away: whatever it held or waited for is released now."""
        self.live.discard(conn)
        self.peers.pop(conn, None)
        for job in self.jobs.values():
            if job.attached != conn:
                continue
            job.attached = None
            job.orphaned_at = time.monotonic()  # no client: a frozen job is thawed after reattach_grace_s
            job.prepared_until = 0.0
            if job.name in self.queue:
                self.drop_waiter(job.name)
            if job.holding:
                job.holding = False
                log.warning("client of job %s disconnected while holding the GPU: releasing it", job.name)
        self.persist()
        self.wake()

    def client_pids(self, job: Job | None, frees_gpu_memory: bool) -> set[int]:
        """Never frozen: the agent itself and every connected client (a trainer driver, say) — except a client
        that registered itself for ``job`` (an SPMD rank is both its job's client and a GPU process) where the
        backend leaves processes running (a stopped client could not ask back)."""
        own = {p.pid for p in job.registered} if job is not None and frees_gpu_memory else set()
        return {os.getpid(), *(set(self.peers.values()) - own)}

    # ------------------------------------------------------------------ the queue

    def enqueue(self, name: str) -> asyncio.Future:
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

    async def wait_for_grant(self, name: str, timeout_s: float | None) -> None:
        fut = self.enqueue(name)
        self._waiting[name] = self._waiting.get(name, 0) + 1  # acquires of this job waiting on fut
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout=timeout_s or None)
        except asyncio.TimeoutError:
            self._stop_waiting(name)
            raise ProtocolError(ErrorCode.TIMEOUT, f"job {name!r} did not get the GPU within {timeout_s:g} s") from None
        except asyncio.CancelledError:
            self._stop_waiting(name)
            raise

    def _stop_waiting(self, name: str) -> None:
        """One acquire gave up: the queue entry goes only when no other acquire of the job still waits."""
        left = self._waiting.get(name, 1) - 1
        if left > 0:
            self._waiting[name] = left
            return
        self.drop_waiter(name)

    def drop_waiter(self, name: str, error: BaseException | None = None) -> None:
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

    def fail_all(self, error: BaseException) -> None:
        for name in list(self.queue):
            self.drop_waiter(name, error)
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_exception(error)
        self.queue.clear()
        self.waiters.clear()

    def grant(self, job: Job) -> None:
        self.queue.popleft()
        job.holding = True
        job.fault = ""
        fut = self.waiters.pop(job.name, None)
        self._waiting.pop(job.name, None)
        if fut is not None and not fut.done():
            fut.set_result(True)
        log.info("grant: job %s owns the GPU", job.name)
        self.persist()

    def describe(self, now: float) -> list[dict[str, Any]]:
        out = []
        for job in self.jobs.values():
            d = job.to_dict()
            d.update(pids=job.pids(), attached=job.attached is not None, prepared=job.prepared_until > now,
                     queued=job.name in self.queue, refused=job.refused)
            del d["procs"], d["registered"]
            out.append(d)
        return out


__all__ = ["MAX_JOBS", "MAX_JOBS_PER_CLIENT", "JobBook"]
