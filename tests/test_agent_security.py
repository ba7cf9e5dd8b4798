"""The agent's security: its socket, peer credentials, state files, links, reused pids and processes off its GPUs —
each a way another user or a stale file could make it touch what is not its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from agent_support import AgentProc, eventually, spawn_worker
from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.agent.freeze.base import FreezeError, FreezeBackend
from timeslice_verl.config.overrides import compose

CLI = [sys.executable, "-m", "timeslice_verl"]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)



def test_the_agent_never_deletes_a_non_socket_at_its_path(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "agent.sock").write_text("precious")
    proc = cli("agent", f"timeslice.agent.socket={run / 'agent.sock'}", "timeslice.agent.backend=sigstop", "timeslice.tenant.url=")
    assert proc.returncode != 0 and "is not a socket" in proc.stderr
    assert (run / "agent.sock").read_text() == "precious"


def test_peer_credentials_fail_closed(tmp_path, monkeypatch):
    from timeslice_verl.agent import server

    from timeslice_verl.agent.client.protocol import peer_credentials

    assert peer_credentials(None) == (None, None)
    settings = compose("interleave", [f"timeslice.agent.socket={tmp_path / 'run' / 'a.sock'}",
                                      "timeslice.agent.backend=sigstop", "timeslice.tenant.url="])
    (tmp_path / "run").mkdir(mode=0o700)
    from timeslice_verl.agent import connections

    monkeypatch.setattr(connections, "peer_credentials", lambda sock: (None, None))

    async def scenario() -> bytes:
        ready = asyncio.Event()
        task = asyncio.create_task(server.run_agent(settings, ready=ready))
        await asyncio.wait_for(ready.wait(), 30)
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "run" / "a.sock"))
        writer.write(b'{"v": 1, "id": 1, "op": "hello"}\n')
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return line

    reply = json.loads(asyncio.run(scenario()))
    assert reply["error"]["code"] == "permission" and "did not report" in reply["error"]["message"]


def test_two_agents_cannot_share_a_state_file(tmp_path):
    first = AgentProc(tmp_path).start()
    try:
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        proc = cli("agent", f"timeslice.agent.socket={other / 'agent.sock'}", f"timeslice.agent.state_file={first.state_file}",
                   "timeslice.agent.backend=sigstop", "timeslice.tenant.url=")
        assert proc.returncode != 0 and "another agent holds" in proc.stderr
    finally:
        first.stop()


def test_sighup_does_not_stop_the_agent(tmp_path):
    agent = AgentProc(tmp_path).start()
    try:
        agent.proc.send_signal(signal.SIGHUP)
        eventually(lambda: "SIGHUP ignored" in agent.log(), what="the agent to handle SIGHUP")
        assert agent.status()["owner"] in ("none", "tenant")  # it still serves
        assert agent.proc.poll() is None
    finally:
        agent.stop()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant a directory owned by another user")
def test_the_client_refuses_a_socket_in_someone_elses_directory(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(planted / "agent.sock"))
    server.listen(1)
    os.chown(planted, 12345, 12345)
    try:
        with pytest.raises(AgentError, match="belongs to uid 12345"):
            AgentClient(planted / "agent.sock", connect_timeout_s=0.5).hello()
    finally:
        server.close()


def test_autostart_never_writes_its_log_through_a_link(tmp_path):
    from timeslice_verl.handoff.connect import start_agent

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    target = tmp_path / "target"
    (run / "agent.log").symlink_to(target)
    settings = compose("interleave", [f"timeslice.agent.socket={run / 'agent.sock'}", "timeslice.tenant.url="])
    with pytest.raises(OSError):
        start_agent(settings)
    assert not target.exists()


def test_a_reused_pid_is_never_touched():
    from test_freeze_backend import P1, ScriptedPrimitives

    prims = ScriptedPrimitives()
    backend = FreezeBackend(prims, probe=None, driver_timeout_s=5)
    with pytest.raises(FreezeError, match="no longer the process the agent recorded"):
        backend.freeze([P1], identities={P1: 1})  # recorded with another start time
    assert prims.calls == []


class _Probe:
    def __init__(self, on_gpu: set[int]) -> None:
        self.on_gpu = on_gpu

    def process_memory(self) -> dict[int, int]:
        return {pid: 1 << 30 for pid in self.on_gpu}


def test_processes_off_the_agents_gpus_are_not_frozen(tmp_path):
    from test_freeze_backend import ScriptedPrimitives

    on, off = spawn_worker("gpu-job"), spawn_worker("gpu-job")
    other = spawn_worker(None)
    try:  # spawn_worker returns once each tag is readable
        backend = FreezeBackend(ScriptedPrimitives(), probe=_Probe({on.pid, other.pid}), driver_timeout_s=5)
        assert backend.discover("gpu-job", []) == [on.pid]
        assert backend.discover("gpu-job", [on.pid, off.pid]) == [on.pid]  # a registered rank elsewhere too
        backend.only_on_gpus = False  # timeslice.agent.freeze_off_gpu=true
        assert backend.discover("gpu-job", []) == sorted([on.pid, off.pid])
        assert backend.discover("gpu-job", [off.pid]) == [off.pid]  # registered ranks only: the tag alone is no rank
    finally:
        for p in (on, off, other):
            p.kill()
