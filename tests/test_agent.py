"""The snapshot agent as a real daemon: real processes, the real socket, the CPU test backend.

The sigstop backend stands in for CUDA checkpoint/restore (it pauses processes and frees no GPU
memory); arbitration, sequencing, persistence and crash handling are the agent's real code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading

import pytest

from agent_support import AgentProc, eventually, spawn_worker, stopped
from timeslice_verl.agent.client import AgentError





def worker(procs, job):
    w = spawn_worker(job)  # returns once the tag is readable
    procs.append(w)
    return w


def test_acquire_release_cycles_move_the_gpu_between_trainer_and_tenant(agent, vllm, procs):
    w = worker(procs, "job-a")
    untagged = worker(procs, None)
    with agent.client() as c:
        for cycle in range(3):
            result = c.acquire("job-a")
            assert vllm.sleeping(), "the tenant must be asleep while the trainer holds the GPU"
            assert not stopped(w.pid)
            assert result["restored"] is (cycle > 0)
            assert agent.status()["owner"] == "job:job-a"
            c.release("job-a", wait=True)
            assert stopped(w.pid), "released job's processes are frozen"
            assert not vllm.sleeping()
            assert agent.status()["owner"] == "tenant"
            assert not stopped(untagged.pid), "an untagged process is never touched"
        job = agent.job("job-a")
        assert job["state"] == "FROZEN" and job["pids"] == [w.pid]
    assert untagged.pid not in agent.job("job-a")["pids"]


def request_in_flight(vllm, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A completion running on the stand-in vLLM (returned once it runs); its reply lands in ``out["r"]``."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", vllm.complete(max_tokens=max_tokens)))
    t.start()
    eventually(lambda: vllm.stats()["running"] == 1, what="request in flight")
    return t, out


def test_trainer_priority_never_sleeps_a_serving_engine(tmp_path, vllm, procs):
    """An acquire while vLLM serves a long request: the agent waits (pause mode=wait), never crashes it."""
    agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=("timeslice.tenant.pause_mode=wait",)).start()
    procs.append(agent)
    worker(procs, "job-a")
    t, out = request_in_flight(vllm, max_tokens=60)  # ~0.6 s of generation
    with agent.client() as c:
        c.acquire("job-a")
        assert vllm.alive(), "the stand-in vLLM exits if slept with a request in flight"
        assert vllm.stats()["completed"] >= 1, "acquire returned only after the request in flight finished"
        t.join(60)
        assert out["r"]["choices"][0]["finish_reason"] == "length", "the in-flight request finished, not aborted"
        # requests arriving while the trainer holds the GPU wait, and are served after release
        late: dict = {}
        t2 = threading.Thread(target=lambda: late.setdefault("r", vllm.complete(max_tokens=3)))
        t2.start()
        eventually(lambda: vllm.stats()["waiting"] == 1, what="the late request queued")
        assert "r" not in late
        c.release("job-a")
        t2.join(10)
        assert late["r"]["choices"][0]["finish_reason"] == "length"
    assert vllm.stats()["aborted"] == 0


def test_pause_keep_hands_over_at_once_and_finishes_the_request_after(agent, vllm, procs):
    """The default pause mode: the trainer waits for no generation; the request in flight is held, not
    aborted, and finishes once the tenant is back."""
    worker(procs, "job-a")
    t, out = request_in_flight(vllm, max_tokens=200)  # ~2 s of generation
    with agent.client() as c:
        c.acquire("job-a")
        assert vllm.stats()["pauses"] == {"keep": 1} and vllm.sleeping()
        c.release("job-a")
    t.join(120)
    assert out["r"]["choices"][0]["finish_reason"] == "length" and vllm.stats()["aborted"] == 0


def test_two_trainer_jobs_are_served_fifo(agent, vllm, procs):
    wa, wb, wc = worker(procs, "job-a"), worker(procs, "job-b"), worker(procs, "job-c")
    order: list[str] = []
    ca, cb, cc = agent.client(), agent.client(), agent.client()
    ca.acquire("job-a")
    order.append("a")

    def take(client, name, key):
        client.acquire(name)
        order.append(key)

    tb = threading.Thread(target=take, args=(cb, "job-b", "b"))
    tb.start()
    eventually(lambda: agent.status()["queue"] == ["job-b"], what="b queued")
    tc = threading.Thread(target=take, args=(cc, "job-c", "c"))
    tc.start()
    eventually(lambda: agent.status()["queue"] == ["job-b", "job-c"], what="c queued behind b")
    assert order == ["a"] and not stopped(wa.pid)
    ca.release("job-a")
    tb.join(5)
    assert order == ["a", "b"]
    eventually(lambda: stopped(wa.pid), what="a frozen")
    assert not stopped(wb.pid) and vllm.sleeping(), "the tenant stays asleep while jobs wait"
    cb.release("job-b")
    tc.join(5)
    assert order == ["a", "b", "c"] and stopped(wb.pid) and not stopped(wc.pid)
    cc.release("job-c", wait=True)
    assert all(stopped(w.pid) for w in (wa, wb, wc)) and not vllm.sleeping()
    for c in (ca, cb, cc):
        c.close()


def test_a_job_used_by_another_client_is_refused(agent, procs):
    worker(procs, "job-a")
    with agent.client() as c1, agent.client() as c2:
        c1.acquire("job-a")
        with pytest.raises(AgentError) as err:
            c2.release("job-a")
        assert err.value.code == "busy"


CLIENT_SCRIPT = """
import sys, time
from timeslice_verl.agent.client import AgentClient
c = AgentClient(sys.argv[1])
c.acquire(sys.argv[2], pids=[int(p) for p in sys.argv[3:]])
print("held", flush=True)
time.sleep(600)
"""


def test_client_killed_while_holding_releases_within_a_second(agent, vllm, procs):
    w = worker(procs, "job-a")
    client = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, str(agent.socket), "job-a"], stdout=subprocess.PIPE, text=True)
    procs.append(client)
    assert client.stdout.readline().strip() == "held"
    assert vllm.sleeping()
    client.kill()
    eventually(lambda: stopped(w.pid) and not vllm.sleeping(), what="release after disconnect")
    eventually(lambda: agent.status()["owner"] == "tenant", what="tenant owns the GPU")


def test_job_processes_dying_while_holding_release_within_a_second(agent, vllm, procs):
    w = worker(procs, "job-a")
    with agent.client() as c:
        c.acquire("job-a", pids=[w.pid])
        assert vllm.sleeping()
        w.kill()
        w.wait()
        eventually(lambda: not vllm.sleeping(), what="tenant woken after the job's processes died")
        eventually(lambda: agent.status()["owner"] == "tenant", what="tenant owns the GPU")


def test_agent_sigkill_and_restart_reconciles_with_the_processes(tmp_path, vllm, procs):
    a = AgentProc(tmp_path, tenant_url=vllm.url).start()
    procs.append(a)
    wa, wb = worker(procs, "job-a"), worker(procs, "job-b")
    ca, cb = a.client(), a.client()
    ca.acquire("job-a")
    ca.release("job-a", wait=True)  # a: FROZEN
    cb.acquire("job-b")  # b: holding
    assert stopped(wa.pid) and not stopped(wb.pid) and vllm.sleeping()
    recorded = json.loads(a.state_file.read_text())
    assert {j["name"]: j["state"] for j in recorded["jobs"]} == {"job-a": "FROZEN", "job-b": "RUNNING"}

    a.kill(signal.SIGKILL)
    assert stopped(wa.pid) and not stopped(wb.pid), "processes keep their state while the agent is down"
    a.start()
    log = a.log()
    assert "restart: job job-a was FROZEN" in log and "-> FROZEN" in log
    # the clients come back by themselves, before any call of theirs: each reattaches its job
    def reattached():
        status = a.status()
        return status if all(j["attached"] for j in status["jobs"]) else None

    status = eventually(reattached, what="both clients reattached")
    jobs = {j["name"]: j for j in status["jobs"]}
    assert jobs["job-a"]["state"] == "FROZEN" and jobs["job-a"]["pids"] == [wa.pid] and not jobs["job-a"]["holding"]
    assert jobs["job-b"]["state"] == "RUNNING" and jobs["job-b"]["holding"]
    assert status["owner"] == "job:job-b" and vllm.sleeping(), "a job that held the GPU keeps it across an agent restart"

    cb.release("job-b", wait=True)  # the old client reconnects transparently
    assert stopped(wb.pid) and not vllm.sleeping()
    ca.acquire("job-a")
    assert not stopped(wa.pid)
    ca.close()
    cb.close()


def test_restart_after_sigkill_mid_freeze_brings_the_job_back_running(tmp_path, vllm, procs):
    """A crash between checkpointing some processes and recording FROZEN: the restart unwinds it."""
    a = AgentProc(tmp_path, tenant_url=vllm.url).start()
    procs.append(a)
    w1, w2 = worker(procs, "job-a"), worker(procs, "job-a")
    with a.client() as c:
        c.acquire("job-a", pids=[w1.pid, w2.pid])
        a.kill(signal.SIGKILL)
    os.kill(w1.pid, signal.SIGSTOP)  # as if the agent died after checkpointing one of two processes
    state = json.loads(a.state_file.read_text())
    state["jobs"][0]["state"], state["jobs"][0]["direction"], state["jobs"][0]["holding"] = "TRANSITIONING", "freeze", False
    a.state_file.write_text(json.dumps(state))
    a.start()
    # recovered to running, then frozen again by the reconciler as nobody holds it
    eventually(lambda: a.job("job-a")["state"] == "FROZEN", what="job-a frozen again after the restart")
    assert stopped(w1.pid) and stopped(w2.pid)
    eventually(lambda: not vllm.sleeping(), what="the tenant woken once job-a is frozen")
    assert "restart: job job-a was TRANSITIONING" in a.log()


def test_sigterm_thaws_frozen_jobs_and_wakes_the_tenant(tmp_path, vllm, procs):
    a = AgentProc(tmp_path, tenant_url=vllm.url).start()
    procs.append(a)
    wa, wb = worker(procs, "job-a"), worker(procs, "job-b")
    with a.client() as ca, a.client() as cb:
        ca.acquire("job-a")
        ca.release("job-a", wait=True)
        cb.acquire("job-b")
        assert stopped(wa.pid) and vllm.sleeping()
        assert a.kill(signal.SIGTERM) == 0
    assert not stopped(wa.pid) and not stopped(wb.pid), "no process left frozen"
    assert not vllm.sleeping(), "no vLLM left asleep"
    assert "agent stopped" in a.log()
    assert not a.socket.exists()


def test_socket_and_directory_are_private(agent):
    assert stat.S_IMODE(os.stat(agent.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(agent.socket.parent).st_mode) == 0o700


def test_a_second_agent_on_the_same_socket_refuses_to_start(tmp_path, agent):
    second = subprocess.run(
        [sys.executable, "-m", "timeslice_verl", "agent", f"timeslice.agent.socket={agent.socket}",
         "timeslice.agent.backend=sigstop"],
        capture_output=True, text=True, timeout=60,
    )
    assert second.returncode != 0 and "already listening" in second.stderr
    assert agent.status()["agent"]["pid"] == agent.proc.pid


def raw_exchange(path, payload: bytes) -> list[dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    data = b""
    s.settimeout(10)
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "payload, code, needle",
    [
        (b"not json\n", "bad_json", "not a JSON object"),
        (b"[1, 2]\n", "bad_json", "expected a JSON object"),
        (b'{"v": 2, "op": "status"}\n', "unsupported_version", "v1"),
        (b'{"v": 1, "op": "explode"}\n', "unknown_op", "explode"),
        (b'{"v": 1, "op": "acquire"}\n', "bad_request", "needs field 'job'"),
        (b'{"v": 1, "op": "acquire", "job": "../etc"}\n', "bad_request", "not a job name"),
        (b'{"v": 1, "op": "acquire", "job": "j", "timeout_s": -1}\n', "bad_request", "'timeout_s'"),
        (b'{"v": 1, "op": "register_pids", "job": "j", "pids": ["1"]}\n', "bad_request", "'pids'"),
        (b'{"v": 1, "op": "register_pids", "job": "j", "pids": [999999999]}\n', "bad_request", "does not exist"),
        (b'{"v": 1, "op": "release", "job": "j", "force": true}\n', "bad_request", "force"),
        (b'{"v": 1, "op": "register_tenant", "urls": ["file:///etc/passwd"]}\n', "bad_request", "http(s) URL"),
        (b'{"v": 1, "op": "register_tenant", "urls": ["http://x"], "sleep_level": 3}\n', "bad_request", "1 or 2"),
        (b'{"v": 1, "op": "register_tenant", "urls": ["http://x:1", "http://x:1/"]}\n', "bad_request", "listed twice"),
    ],
)
def test_malformed_requests_get_clear_errors_and_the_agent_lives(agent, payload, code, needle):
    replies = raw_exchange(agent.socket, payload)
    assert len(replies) == 1 and replies[0]["ok"] is False
    assert replies[0]["error"]["code"] == code
    assert needle in replies[0]["error"]["message"]
    assert agent.status()["owner"] in ("tenant", "none")


def test_own_pid_and_oversized_requests(agent):
    reply = raw_exchange(agent.socket, json.dumps({"v": 1, "id": 5, "op": "register_pids", "job": "j", "pids": [agent.proc.pid]}).encode() + b"\n")
    assert reply[0]["id"] == 5 and reply[0]["error"]["code"] == "permission"
    huge = b'{"v": 1, "op": "status", "pad": "' + b"x" * 70000 + b'"}\n'
    reply = raw_exchange(agent.socket, huge)
    assert reply[0]["error"]["code"] == "too_large"
    assert agent.status()["agent"]["pid"] == agent.proc.pid


def test_acquire_timeout_leaves_the_queue_clean(agent, procs):
    worker(procs, "job-a")
    worker(procs, "job-b")
    with agent.client() as ca, agent.client() as cb:
        ca.acquire("job-a")
        with pytest.raises(AgentError) as err:
            cb.acquire("job-b", timeout_s=0.3)
        assert err.value.code == "timeout"
        assert agent.status()["queue"] == []


def test_prepare_restores_before_the_acquire(agent, vllm, procs):
    w = worker(procs, "job-a")
    with agent.client() as c:
        c.acquire("job-a")
        c.release("job-a", wait=True)
        assert stopped(w.pid) and not vllm.sleeping()
        assert c.prepare("job-a")["accepted"]
        # the agent's own view, not the processes': the thaw is done once the job is RUNNING again
        eventually(lambda: agent.job("job-a")["state"] == "RUNNING" and vllm.sleeping(), what="prepared: restored early")
        result = c.acquire("job-a")
        assert result["thawed"] is False, "already thawed by prepare: the acquire found it ready"


def test_prepare_expires_and_gives_the_gpu_back(agent, vllm, procs):
    w = worker(procs, "job-a")
    with agent.client() as c:
        c.acquire("job-a")
        c.release("job-a", wait=True)
        c.prepare("job-a", ttl_s=0.3)
        eventually(lambda: vllm.sleeping(), what="prepare took the GPU")
        eventually(lambda: stopped(w.pid) and not vllm.sleeping(), timeout=5, what="prepare expired")


def test_tenant_that_dies_never_blocks_the_trainer(agent, vllm, procs):
    worker(procs, "job-a")
    vllm.stop()
    with agent.client() as c:
        c.acquire("job-a")  # returns (a dead tenant holds nothing to hand over)
        status = agent.status()
        assert status["tenant"]["state"] == "dead" and status["owner"] == "job:job-a"
        c.release("job-a", wait=True)
    assert agent.job("job-a")["state"] == "FROZEN"


def test_status_cli_renders_the_state(agent, procs):
    worker(procs, "job-a")
    with agent.client() as c:
        c.acquire("job-a")
        out = subprocess.run(
            [sys.executable, "-m", "timeslice_verl", "status", f"timeslice.agent.socket={agent.socket}"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
    assert "GPU owner: job:job-a" in out and "CPU TEST BACKEND" in out and "job-a" in out and "asleep" in out


def test_the_agent_imports_neither_verl_nor_pluggy():
    probe = (
        "import sys, timeslice_verl.agent.server, timeslice_verl.agent.client, timeslice_verl.agent.metrics;"
        "bad = [m for m in ('verl', 'pluggy', 'torch', 'ray') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
