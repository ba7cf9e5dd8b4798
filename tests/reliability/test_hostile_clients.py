"""Hostile clients and tenants against the real agent: bad input, floods of malformed messages, another user's
tagged process, thousands of job names, hanging tenants, remote tenant URLs, clients that pipeline and never read.

Real agent processes (CPU ``sigstop`` backend), real tagged workers, the stand-in vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agent_support import AgentProc, FakeVllmProc, eventually, node, spawn_worker, stopped


# --------------------------------------------------------------------------- 11. bad input


BAD = [
    (b'{"v": 1, "id": 1, "op": "acquire", "job": "a", "timeout_s": ' + b"9" * 5000 + b"}", "bad_json"),
    (b"[" * 2000 + b"]" * 2000, "bad_json"),
    (b'{"v": 1, "id": 1, "op": "acquire", "job": "a", "timeout_s": 1' + b"0" * 309 + b"}", "bad_request"),
    (b'{"v": 1, "id": 1, "op": "register_tenant", "urls": ["http://[::1"]}', "bad_request"),
    (b'{"v": 1, "id": 1, "op": "register_tenant", "urls": ["http://host:99999"]}', "bad_request"),
    (b'{"v": 1, "id": 1, "op": "acquire", "job": "a\\n"}', "bad_request"),
    (b'{"v": true, "id": 1, "op": "hello"}', "unsupported_version"),
]


@pytest.mark.parametrize("line, code", BAD, ids=["huge-int", "deep-nesting", "309-digit-timeout", "bad-ipv6", "bad-port",
                                                  "newline-in-job", "v-true"])
def test_bad_input_gets_a_clear_error_never_internal(line, code):
    from timeslice_verl.agent.client import protocol

    with pytest.raises(protocol.ProtocolError) as info:
        protocol.parse_request(line)
    assert info.value.code == code


def test_ten_thousand_malformed_messages_leave_the_agent_serving(tmp_path):
    import random

    agent = AgentProc(tmp_path).start()
    rng = random.Random(7)
    pieces = [b"{", b"}", b"[", b"]", b'"v"', b":", b"1", b"true", b"null", b'"op"', b'"acquire"', b'"job"', b",", b"\xff", b"9" * 50]
    lines = [b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(10_000)]
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(str(agent.socket))
        chunks: list[bytes] = []

        def read_all() -> None:  # read while sending: the agent stops reading a client that does not read
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    return
                chunks.append(chunk)

        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        for i in range(0, len(lines), 500):
            s.sendall(b"\n".join(lines[i:i + 500]) + b"\n")
        s.shutdown(socket.SHUT_WR)
        reader.join(60)
        replies = [json.loads(x) for x in b"".join(chunks).splitlines() if x.strip()]
        s.close()
        assert len(replies) == len(lines), "every request gets its reply, the last ones after the half-close too"
        assert not any(r.get("error", {}).get("code") == "internal" for r in replies)
        assert agent.status()["owner"] in ("none", "tenant") and agent.proc.poll() is None
    finally:
        agent.stop()


# --------------------------------------------------------------------------- 12. another user's tagged process


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process as another user")
def test_tag_discovery_never_takes_another_users_process(tmp_path, procs):
    theirs = subprocess.Popen(["sleep", "60"], env=dict(os.environ, TIMESLICE_JOB="shared-name"), user=12345)
    ours = spawn_worker("shared-name")
    agent = AgentProc(tmp_path).start()
    procs += [theirs, ours, agent]
    eventually(lambda: b"TIMESLICE_JOB=shared-name" in Path(f"/proc/{theirs.pid}/environ").read_bytes(), what="tagged")
    with agent.client() as c:
        c.acquire("shared-name")
        c.release("shared-name", wait=True)
    eventually(lambda: stopped(ours.pid), what="our process frozen")
    assert not stopped(theirs.pid), "uid 12345's process carries the tag but is not ours"
    assert agent.job("shared-name")["pids"] == [ours.pid]


# --------------------------------------------------------------------------- 7. thousands of job names


def test_job_names_are_bounded_per_client_and_the_trainer_is_not_starved(tmp_path, procs):
    from timeslice_verl.agent.jobs import MAX_JOBS_PER_CLIENT
    from timeslice_verl.agent.client import AgentError

    procs.append(spawn_worker("real-job"))
    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    with agent.client() as flood:
        for i in range(MAX_JOBS_PER_CLIENT):
            flood.prepare(f"idle-{i}")
        with pytest.raises(AgentError, match="too many jobs"):
            flood.prepare("one-too-many")
        with agent.client() as trainer:
            trainer.acquire("real-job", timeout_s=120)  # the trainer gets its GPU despite the idle names


# --------------------------------------------------------------------------- 9. a hanging tenant


def test_a_hanging_wake_up_never_delays_the_trainer(tmp_path):
    # waiting for the hanging call would take 10 minutes: far past the acquire's own timeout below
    with node(tmp_path, "hang-job", "--hang", "wake_up", extra=("timeslice.tenant.request_timeout_s=600",)) as (agent, _vllm, _worker):
        with agent.client() as c:
            c.acquire("hang-job")
            c.release("hang-job")  # the agent freezes the job and starts waking the tenant: /wake_up hangs
            eventually(lambda: "tenant reclaim" in agent.status()["transition"], what="reclaim under way")
            c.acquire("hang-job", timeout_s=120)  # the trainer does not wait for the tenant's hanging wake-up


def test_sigterm_exits_promptly_during_a_hanging_pause(tmp_path):
    extra = ("timeslice.tenant.request_timeout_s=600", "timeslice.tenant.drain_timeout_s=600")
    with node(tmp_path, "hang-pause", "--hang", "pause", extra=extra) as (agent, _vllm, worker):
        client = agent.client()
        threading.Thread(target=lambda: _quietly(client.acquire, "hang-pause"), daemon=True).start()
        eventually(lambda: "tenant yield" in agent.status()["transition"], what="yield under way")
        # the pause would hang for 20 minutes: the agent exits without it (kill() gives up after 30 s)
        assert agent.kill(signal.SIGTERM) == 0
        assert not stopped(worker.pid)


def _quietly(fn, *args):
    try:
        fn(*args)
    except Exception:
        pass


# --------------------------------------------------------------------------- 12. tenant URLs, 6. clients that never read


def test_a_client_cannot_point_the_agent_at_a_remote_tenant(tmp_path):
    from timeslice_verl.agent.client import AgentError

    vllm = FakeVllmProc()
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    try:
        with agent.client() as c:
            c.call("unregister_tenant")
            with pytest.raises(AgentError, match="not on this node"):
                c.call("register_tenant", urls=["http://10.20.30.40:8000"])  # refused before any connection is made
            c.call("register_tenant", urls=[vllm.url])  # the configured one (loopback) is fine
            assert agent.status()["tenant"]["urls"] == [vllm.url]
    finally:
        agent.stop()
        vllm.stop()


def test_a_client_that_pipelines_and_never_reads_is_bounded_and_harmless(tmp_path):
    agent = AgentProc(tmp_path).start()
    try:
        before = int(Path(f"/proc/{agent.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(agent.socket))
        s.setblocking(False)
        line = json.dumps({"v": 1, "id": 1, "op": "status"}).encode() + b"\n"
        sent, deadline = 0, time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                s.send(line * 100)
                sent += 100
            except BlockingIOError:  # the agent stopped reading us: backpressure
                time.sleep(0.01)
        after = int(Path(f"/proc/{agent.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])
        assert after - before < 64 * 1024, f"agent RSS grew {(after - before) / 1024:.0f} MiB after {sent} unread requests"
        s.close()
        assert agent.status()["owner"] in ("none", "tenant"), "the agent answers others after that client leaves"
    finally:
        agent.stop()
