"""Faults, races and floods from the reliability review, each one reproduced and checked fixed.

Real agent processes (CPU ``sigstop`` backend), real tagged workers, the stand-in vLLM; the in-process
tests drive the real :class:`Arbiter` with a backend whose discovery can be held mid-scan.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal
import socket
import threading
import urllib.request
from pathlib import Path

import pytest

from agent_support import AgentProc, FakeVllmProc, eventually, node, spawn_worker, stopped
from timeslice_verl.agent import procfs
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.options import AgentOptions
from timeslice_verl.agent.freeze import make_backend
from timeslice_verl.agent.state import FROZEN, Job, StateStore


# --------------------------------------------------------------------------- 1. frozen, then forgotten


class HeldDiscovery:
    """The sigstop backend, with discovery held until the test lets it go (a slow /proc scan)."""

    def __init__(self) -> None:
        self.backend = make_backend("sigstop", probe=None, driver_timeout_s=5)
        self.scanning = threading.Event()
        self.go = threading.Event()
        real = self.backend.discover

        def discover(*args, **kwargs):
            self.scanning.set()
            self.go.wait(10)
            return real(*args, **kwargs)

        self.backend.discover = discover


async def holding(tmp_path: Path, held: HeldDiscovery, job: str) -> Arbiter:
    """An in-process arbiter whose one client (connection 1) holds the GPU for ``job``."""
    arbiter = Arbiter(held.backend, StateStore(tmp_path / "state.json"), agent=AgentOptions(watch_interval_s=3600))
    await arbiter.start()
    arbiter.connection_opened(1, None)
    await arbiter.acquire(job, 1)
    return arbiter


def test_a_job_forgotten_during_its_freeze_is_never_frozen(tmp_path):
    worker = spawn_worker("race-job")
    held = HeldDiscovery()

    async def scenario() -> None:
        arbiter = await holding(tmp_path, held, "race-job")
        await arbiter.release("race-job", 1)  # the reconciler starts the freeze: discovery is held
        await asyncio.to_thread(held.scanning.wait, 10)
        arbiter.disconnect(1)  # the client dies mid-scan
        await arbiter.watchdog.watch_once()
        assert "race-job" in arbiter.book.jobs, "a job that was never frozen is not forgotten (its processes may be on the GPU)"
        held.go.set()
        await arbiter.settled(20)
        job = arbiter.book.jobs.get("race-job")
        assert job is not None and job.state == FROZEN and job.pids() == [worker.pid], "frozen and still tracked"
        await arbiter.shutdown()

    try:
        asyncio.run(scenario())
        assert not stopped(worker.pid), "shutdown thaws what was frozen"
    finally:
        held.go.set()
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


def test_a_freeze_whose_job_was_dropped_meanwhile_touches_nothing(tmp_path):
    worker = spawn_worker("dropped-job")
    held = HeldDiscovery()

    async def scenario() -> None:
        arbiter = Arbiter(held.backend, StateStore(tmp_path / "state.json"), agent=AgentOptions(watch_interval_s=3600))
        await arbiter.start()
        job = arbiter.book.jobs["dropped-job"] = Job(name="dropped-job")
        freeze = asyncio.create_task(arbiter.executor.freeze(job))
        await asyncio.to_thread(held.scanning.wait, 10)
        del arbiter.book.jobs["dropped-job"]
        held.go.set()
        await freeze
        await arbiter.shutdown()

    try:
        asyncio.run(scenario())
        assert not stopped(worker.pid), "a process of a forgotten job is never stopped"
    finally:
        held.go.set()
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


def test_a_run_that_ends_during_its_last_freeze_is_not_frozen(tmp_path):
    """Seen on the H200: a resident release at the run's last step, then at once the run's done; the freeze the first
    started took its swap from the second (none: checkpoint) and the driver moved 19 GiB, 14 s there and back."""
    worker = spawn_worker("ending-job")
    held = HeldDiscovery()

    async def scenario() -> list:
        arbiter = await holding(tmp_path, held, "ending-job")
        await arbiter.release("ending-job", 1, swap="resident",
                              parked=[{"pid": worker.pid, "parked": 0, "kept": 2**30}])
        await asyncio.to_thread(held.scanning.wait, 10)  # the freeze's scan is under way
        await arbiter.release("ending-job", 1, done=True)
        assert arbiter.book.jobs["ending-job"].swap == "resident", "a done leaves the swap of the release before it"
        held.go.set()
        await arbiter.settled(20)
        freezes = [t for _, t in arbiter.journal.moves if t.action == "freeze"]
        gone = "ending-job" not in arbiter.book.jobs
        await arbiter.shutdown()
        return [freezes, gone]

    try:
        freezes, gone = asyncio.run(scenario())
        assert freezes == [], f"the job ended: nothing to freeze, got {freezes}"
        assert gone, "the ended job is forgotten"
        assert not stopped(worker.pid)
    finally:
        held.go.set()
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


# --------------------------------------------------------------------------- 2. out of file descriptors


def test_an_unreadable_proc_is_not_an_exited_process(tmp_path, monkeypatch):
    worker = spawn_worker("fd-job")

    async def scenario() -> None:
        arbiter = Arbiter(make_backend("sigstop", probe=None, driver_timeout_s=5), StateStore(tmp_path / "s.json"),
                          agent=AgentOptions(watch_interval_s=3600))
        await arbiter.start()
        job = arbiter.book.jobs["fd-job"] = Job(name="fd-job", state=FROZEN, procs=[procfs.identify(worker.pid)])
        real = Path.read_text

        def emfile(self, *a, **kw):
            if self.name == "stat" and self.parent.name == str(worker.pid):
                raise OSError(errno.EMFILE, "Too many open files")
            return real(self, *a, **kw)

        monkeypatch.setattr(Path, "read_text", emfile)
        with pytest.raises(procfs.ProcUnreadable):
            procfs.alive(job.procs[0])
        await arbiter.watchdog.watch_once()
        monkeypatch.setattr(Path, "read_text", real)
        assert arbiter.book.jobs["fd-job"].pids() == [worker.pid], "the frozen pid is still known"
        assert arbiter.book.jobs["fd-job"].state == FROZEN
        await arbiter.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        worker.kill()


def test_connections_are_bounded(tmp_path):
    from timeslice_verl.agent.server import MAX_CONNECTIONS

    agent = AgentProc(tmp_path).start()
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(agent.socket))
            socks.append(s)
        last = socks[-1]  # answered: the agent has accepted every connection before it
        last.sendall(json.dumps({"v": 1, "id": 1, "op": "hello", "client": "t"}).encode() + b"\n")
        assert json.loads(last.makefile("rb").readline())["ok"]
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        extra.settimeout(15)
        extra.connect(str(agent.socket))
        reply = json.loads(extra.makefile("rb").readline())  # the agent says why before it closes
        extra.close()
        assert reply["error"]["code"] == "busy" and str(MAX_CONNECTIONS) in reply["error"]["message"]
    finally:
        for s in socks:
            s.close()
        agent.stop()


# --------------------------------------------------------------------------- 3. a holder that never comes back


def test_a_holder_that_does_not_come_back_after_a_restart_is_released(tmp_path):
    vllm = FakeVllmProc()
    wa, wb = spawn_worker("job-a"), spawn_worker("job-b")
    extra = ("timeslice.agent.reattach_grace_s=1",)
    agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=extra).start()
    try:
        client_a = agent.client()
        client_a.acquire("job-a")
        agent.kill()  # the agent dies while job-a holds the GPU; job-a's client never reconnects (it is gone too)
        client_a.close()
        agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=extra).start()
        with agent.client() as client_b:
            client_b.acquire("job-b", timeout_s=120)  # granted once job-a's grace (1 s) is over
    finally:
        for w in (wa, wb):
            os.kill(w.pid, signal.SIGCONT)
            w.kill()
        agent.stop()
        vllm.stop()


# --------------------------------------------------------------------------- 4. killed between /pause and /sleep


def test_a_tenant_left_paused_is_resumed_after_a_restart(tmp_path):
    vllm = FakeVllmProc()
    try:
        urllib.request.urlopen(urllib.request.Request(f"{vllm.url}/pause?mode=wait", method="POST"), timeout=5)
        assert vllm.get("/is_paused")["is_paused"] is True
        agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
        try:
            eventually(lambda: vllm.get("/is_paused")["is_paused"] is False, timeout=15, what="tenant resumed")
            assert agent.status()["tenant"]["state"] == "awake"
        finally:
            agent.stop()
    finally:
        vllm.stop()


# --------------------------------------------------------------------------- 5. pipelined acquires


def test_pipelined_acquires_each_get_a_reply(tmp_path, procs):
    procs += [spawn_worker("pipe-a"), spawn_worker("pipe-b")]
    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    holder = agent.client()
    holder.acquire("pipe-b")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(agent.socket))
    s.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in (
        {"v": 1, "id": 1, "op": "acquire", "job": "pipe-a", "timeout_s": 0.3},
        {"v": 1, "id": 2, "op": "acquire", "job": "pipe-a"})))
    lines = s.makefile("rb")
    first = json.loads(lines.readline())  # the first times out while pipe-b holds the GPU
    holder.release("pipe-b")  # only then is the GPU free for the second
    replies = [first, json.loads(lines.readline())]
    s.close()
    by_id = {r["id"]: r for r in replies}
    assert by_id[1]["ok"] is False and by_id[1]["error"]["code"] == "timeout"
    assert by_id[2]["ok"] is True, "the second acquire still gets the GPU once it is free"


# --------------------------------------------------------------------------- 8. a failing tenant is retried with backoff


def test_a_failing_wake_up_is_retried_with_backoff(tmp_path):
    with node(tmp_path, "backoff-job", "--fail-wake-up") as (agent, vllm, _worker):
        with agent.client() as c:
            c.acquire("backoff-job")
            c.release("backoff-job")
        eventually(lambda: vllm.stats()["wake_up_calls"] >= 3, what="three tries to wake the tenant")

        def delays() -> list[float]:  # the agent logs a try's delay after the tenant answered it: read it when written
            return [float(d) for d in re.findall(r"next try in ([0-9.]+) s", agent.log())]

        eventually(lambda: len(delays()) >= 3, what="three failed tries logged with their delay")
        assert delays()[:3] == [0.5, 1.0, 2.0], f"no hot loop: the delay doubles ({delays()})"
