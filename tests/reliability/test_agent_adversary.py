"""The agent under an adversary: a tenant that never answers, broken state files, impossible figures, clients that
vanish or half-close, few file descriptors. Each test reproduces one failure and checks it stays fixed; the numbers in
the section comments are the rows of tests/reliability/README.md's table for this file.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from agent_support import PY, AgentProc, FakeVllmProc, eventually, spawn_worker, stopped
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.options import AgentOptions
from timeslice_verl.agent.client import AgentError
from timeslice_verl.agent.freeze import make_backend
from timeslice_verl.agent.gpu import GpuMemory
from timeslice_verl.agent.state import StateStore

GIB = 2**30


def _arbiter(tmp_path: Path, probe: Any = None, **agent: Any) -> Arbiter:
    return Arbiter(make_backend("sigstop", probe=None, driver_timeout_s=5), StateStore(tmp_path / "state.json"),
                   probe=probe, agent=AgentOptions(**{"watch_interval_s": 3600, **agent}))


def _raw(sock: Path, *messages: dict | bytes, read: int) -> list[dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(str(sock))
    s.sendall(b"".join(m if isinstance(m, bytes) else json.dumps(m).encode() + b"\n" for m in messages))
    s.shutdown(socket.SHUT_WR)  # half-close: the agent still owes every reply
    buf = b""
    while buf.count(b"\n") < read:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
    s.close()
    return [json.loads(line) for line in buf.splitlines() if line.strip()]


# --------------------------------------------------------------------------- 1. a tenant that never answers /pause


def test_the_agent_answers_others_and_says_which_tenant_call_it_waits_for(tmp_path, procs):
    vllm = FakeVllmProc("--hang", "pause")
    worker = spawn_worker("hang-job")
    # no reclaim deadline: the agent waits on the tenant (with one, the ladder ends the wait: tests/test_ladder.py)
    agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=("timeslice.tenant.reclaim_deadline_s=0",)).start()
    procs += [vllm, worker, agent]
    done = threading.Event()

    def acquire() -> None:
        try:
            agent.client().acquire("hang-job")
        except AgentError:
            pass
        done.set()

    threading.Thread(target=acquire, daemon=True).start()
    status = eventually(lambda: "POST /pause" in (s := agent.status())["waiting_for"] and s,
                        what="the yield to reach /pause")
    assert status["waiting_for"].startswith(f"POST /pause?mode=keep&clear_cache=false on {vllm.url} for ")
    assert "tenant yield" in status["transition"]
    assert not done.is_set(), "status was answered while the acquire still waits on the tenant"
    from timeslice_verl.tools.status import render_status

    assert "waiting for the tenant: POST /pause" in render_status(status)


# --------------------------------------------------------------------------- 2. broken state files


def test_a_state_file_with_an_unparsable_tenant_url_is_moved_aside_and_the_agent_serves(tmp_path):
    agent = AgentProc(tmp_path)
    agent.state_file.parent.mkdir(mode=0o700, exist_ok=True)
    agent.state_file.write_text(json.dumps({"version": 1, "jobs": [], "tenant": {"url": "http://[::1", "state": "asleep"}}))
    agent.start()
    try:
        assert agent.status()["tenant"] is None
        assert list(agent.state_file.parent.glob(agent.state_file.name + ".broken-*"))
    finally:
        agent.stop()


def test_a_truncated_state_file_still_thaws_the_registered_worker_it_names(tmp_path, procs):
    worker = spawn_worker(None)  # registered by pid, no tag: only the state file knows it
    agent = AgentProc(tmp_path).start()
    procs += [worker, agent]
    with agent.client() as c:
        c.register_pids("reg-job", [worker.pid])
        c.acquire("reg-job")
        c.release("reg-job", wait=True)
    assert stopped(worker.pid)
    agent.kill(signal.SIGKILL)
    text = agent.state_file.read_text()
    end = text.index("}", text.index('"pid"', text.index('"registered"'))) + 1
    agent.state_file.write_text(text[:end])  # cut mid-write, right after the worker's record
    agent.start()
    eventually(lambda: not stopped(worker.pid), timeout=30, what="the worker thawed at start")
    assert agent.kill(signal.SIGTERM) == 0
    assert not stopped(worker.pid)


# --------------------------------------------------------------------------- 3, 4. impossible park figures


@pytest.mark.parametrize("figure", ["parked", "kept"])
def test_a_park_release_claiming_more_than_a_gpu_holds_is_refused(tmp_path, procs, figure):
    worker = spawn_worker("park-job")
    agent = AgentProc(tmp_path).start()
    procs += [worker, agent]
    with agent.client() as c:
        c.acquire("park-job")
        report = {"pid": worker.pid, "parked": GIB, "kept": 0, figure: 2**50}
        with pytest.raises(AgentError, match=rf"bad_request.*|pid {worker.pid} reports {figure}=1048576.00 GiB") as refused:
            c.release("park-job", swap="park", parked=[report])
        assert refused.value.code == "bad_request"
        assert f"reports {figure}=1048576.00 GiB, more than any GPU holds" in refused.value.message
        assert agent.job("park-job")["holding"], "nothing was released"


class _Probe:
    driver_version = "test"

    def largest_gpu(self) -> int:
        return 80 * GIB

    def memory(self) -> GpuMemory:
        return GpuMemory(total=80 * GIB, used=0, free=80 * GIB)

    def process_memory(self) -> dict[int, int]:
        return {}


def test_with_nvml_the_bound_is_the_agents_largest_gpu(tmp_path):
    from timeslice_verl.agent.client.protocol import ProtocolError

    async def scenario() -> None:
        arbiter = _arbiter(tmp_path, probe=_Probe())
        for figure in ("parked", "kept"):
            with pytest.raises(ProtocolError, match=rf"{figure}=100.00 GiB, more than one of the agent's GPUs holds \(80.00 GiB\)"):
                arbiter._check_park_reports([{"pid": 1234, "parked": GIB, "kept": 0, figure: 100 * GIB}])
        arbiter._check_park_reports([{"pid": 1234, "parked": 40 * GIB, "kept": 2 * GIB}])

    asyncio.run(scenario())


# --------------------------------------------------------------------------- 5. frozen, and nobody left to acquire


def test_frozen_processes_whose_client_is_gone_are_thawed_after_the_grace(tmp_path):
    worker = spawn_worker("orphan-job")

    async def scenario() -> None:
        arbiter = _arbiter(tmp_path, reattach_grace_s=0.0)
        await arbiter.start()
        arbiter.connection_opened(1, None)
        await arbiter.acquire("orphan-job", 1)
        await arbiter.release("orphan-job", 1, wait=True)
        assert stopped(worker.pid)
        arbiter.disconnect(1)  # the leader rank was killed: its peers stay frozen with no client
        await arbiter.watchdog.watch_once()  # the grace (0 s here) is over
        await arbiter.settled(30)
        assert not stopped(worker.pid), "thawed: nobody would ever acquire them again"
        assert "orphan-job" not in arbiter.book.jobs or arbiter.book.jobs["orphan-job"].ending
        await arbiter.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


# --------------------------------------------------------------------------- 6. one agent per GPU


def test_a_second_agent_on_the_same_gpu_refuses_to_start_whatever_its_paths(tmp_path, procs):
    (tmp_path / "a").mkdir()
    first = AgentProc(tmp_path / "a").start()
    procs.append(first)
    second = tmp_path / "b"
    second.mkdir(mode=0o700)
    args = [PY, "-m", "timeslice_verl", "agent", f"timeslice.agent.socket={second / 'agent.sock'}",
            "timeslice.agent.backend=sigstop", "timeslice.tenant.url=", f"timeslice.agent.lock_dir={first.socket.parent}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "another agent already arbitrates GPU 0" in done.stderr, done.stderr
    link = second / "state-link.json"
    link.symlink_to(first.state_file)  # the same state file through a link, and another GPU lock directory
    (second / "locks").mkdir()
    done = subprocess.run([*args[:-1], f"timeslice.agent.lock_dir={second / 'locks'}", f"timeslice.agent.state_file={link}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "another agent holds" in done.stderr, done.stderr
    assert first.status()["agent"]["pid"] == first.proc.pid


# --------------------------------------------------------------------------- 7, 10. bad URLs, concurrent (un)registration


def test_a_tenant_url_with_a_control_character_is_a_bad_request(tmp_path, procs):
    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    replies = _raw(agent.socket, *({"v": 1, "id": i, "op": "register_tenant", "urls": [url]} for i, url in enumerate(
        ["http://127.0.0.1:1/\x01", "http://127.0.0.1:1/a b", "http://127.0.0.1:1\x7f", "http://[::1"])), read=4)
    assert [r["error"]["code"] for r in replies] == ["bad_request"] * 4, replies


def test_concurrent_registrations_and_unregistrations_never_answer_internal_and_agree_with_the_end_state(tmp_path, procs):
    vllm = FakeVllmProc()
    procs.append(vllm)

    async def scenario() -> None:
        arbiter = _arbiter(tmp_path)
        await arbiter.start()
        for _ in range(10):
            await arbiter.register_tenant([vllm.url])
            order: list[str] = []

            async def reg() -> None:
                await arbiter.register_tenant([vllm.url])
                order.append("register")

            async def unreg() -> None:
                await arbiter.unregister_tenant()
                order.append("unregister")

            await asyncio.gather(reg(), unreg(), unreg())
            if order[-1] == "register":
                assert arbiter.tenancy.tenant is not None and not arbiter.tenancy.tenant._client.is_closed, order
            else:
                assert arbiter.tenancy.tenant is None, order
        await arbiter.shutdown()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- 8. one server, two spellings


def test_one_server_written_two_ways_is_one_server(tmp_path, procs):
    from timeslice_verl.config.schema import ConfigError, load_settings

    with pytest.raises(ConfigError, match="listed twice"):
        load_settings({"tenant": {"urls": ["http://127.0.0.1:8001", "http://localhost:8001/"]}})
    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    reply = _raw(agent.socket, {"v": 1, "id": 1, "op": "register_tenant", "urls": ["http://localhost:9001", "http://127.0.0.1:9001"]},
                 read=1)[0]
    assert reply["error"]["code"] == "bad_request" and "listed twice" in reply["error"]["message"]


# --------------------------------------------------------------------------- 9. few file descriptors


def test_with_few_file_descriptors_connections_are_refused_politely_and_the_state_is_written(tmp_path, procs):
    worker = spawn_worker("fd-job")
    procs.append(worker)
    agent = AgentProc(tmp_path, preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))).start()
    procs.append(agent)
    clients = []
    c = agent.client()
    c.hello()  # connected before the flood
    try:
        for _ in range(300):  # more than the agent could hold open
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(agent.socket))
            clients.append(s)
        c.acquire("fd-job")
        c.release("fd-job", wait=True)
        busy = json.loads(clients[-1].recv(4096).splitlines()[0])
        assert busy["error"]["code"] == "busy" and "at most 48 connections" in busy["error"]["message"]
    finally:
        c.close()
        for s in clients:
            s.close()
    assert json.loads(agent.state_file.read_text())["jobs"][0]["state"] == "FROZEN"
    assert "out of system resource" not in agent.log(), "connections were refused before descriptors ran out"

# --------------------------------------------------------------------------- 11. a client that half-closes


def test_a_client_that_half_closes_gets_every_reply(tmp_path, procs):
    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    replies = _raw(agent.socket, *({"v": 1, "id": i, "op": "hello", "client": "t"} for i in range(2000)), read=2000)
    assert sorted(r["id"] for r in replies) == list(range(2000))


# --------------------------------------------------------------------------- 12. off the event loop, under the step lock


def test_the_state_file_is_written_off_the_event_loop(tmp_path, monkeypatch):
    writers: list[str] = []
    real = StateStore._write

    def spy(self, data: bytes) -> None:
        writers.append(threading.current_thread().name)
        real(self, data)

    monkeypatch.setattr(StateStore, "_write", spy)

    async def scenario() -> None:
        arbiter = _arbiter(tmp_path)
        await arbiter.start()
        writers.clear()
        arbiter.connection_opened(1, None)
        await arbiter.acquire("loop-job", 1)
        assert arbiter.store.flush(30)
        await arbiter.shutdown()

    asyncio.run(scenario())
    assert writers and set(writers) == {"timeslice-state"}, writers
    assert json.loads((tmp_path / "state.json").read_text())["jobs"][0]["name"] == "loop-job"


def test_the_watchdog_never_registers_the_tenant_again_during_a_move(tmp_path, procs):
    vllm = FakeVllmProc()
    procs.append(vllm)

    async def scenario() -> None:
        arbiter = _arbiter(tmp_path)
        await arbiter.start([vllm.url])
        arbiter.tenancy.record.state = "dead"  # it stopped answering a while ago, and answers again now
        calls: list[bool] = []
        real = arbiter.tenancy.tenant.register

        async def register():
            calls.append(arbiter.step_lock.locked())
            return await real()

        arbiter.tenancy.tenant.register = register
        async with arbiter.step_lock:  # a move is under way
            await arbiter.watchdog.watch_once()
        assert calls == [], "not during the move"
        arbiter.tenancy.next_probe = 0.0
        await arbiter.watchdog.watch_once()
        assert calls == [True], "after it, and holding the step lock itself"
        assert arbiter.tenancy.record.state == "awake"
        await arbiter.shutdown()

    asyncio.run(scenario())
