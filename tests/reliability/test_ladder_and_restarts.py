"""The ladder, the way back and agent restarts under an adversary. Each test reproduces one failure and checks it
stays fixed; the numbers in the section comments are the rows of tests/reliability/README.md's table for this file.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import signal
import socket
import sys
import tomllib
from pathlib import Path

import pytest

from agent_support import AgentProc, FakeVllmProc, eventually, proc_state, spawn_worker, stopped
from timeslice_verl.agent.tenant import proc as tenant_proc

ROOT = Path(__file__).resolve().parents[2]
HUNG_FOR_MINUTES = 60.0


def _free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _can_bind(host: str) -> bool:
    try:
        _free_port(host)
        return True
    except OSError:
        return False


def _yields(reply: dict) -> list[dict]:
    return [t for t in reply["transitions"] if t["action"] == "tenant_yield"]


# --------------------------------------------------------------------------- 1. what the agent imports is declared


def _third_party_imports(folder: Path) -> set[str]:
    """Top-level names of every import (module level and inside functions) outside the standard library."""
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "timeslice_verl"}


def test_every_module_the_agent_imports_is_a_declared_dependency_of_the_core():
    declared = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-")
                for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for module in _third_party_imports(ROOT / "src" / "timeslice_verl" / "agent"):
        providers = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not providers & declared:
            missing[module] = sorted(providers)
    assert not missing, f"imported by the agent but not a dependency of the core: {missing}"


# --------------------------------------------------------------------------- 2. a tenant group kills the wedged server


def test_in_a_tenant_group_only_the_server_that_hangs_is_killed(tmp_path, procs):
    good, wedged = FakeVllmProc(tagged=True), FakeVllmProc("--hang", "pause", tagged=True)
    procs += [good, wedged]
    agent = AgentProc(tmp_path, extra=(f'timeslice.tenant.urls=["{good.url}","{wedged.url}"]',
                                       "timeslice.tenant.reclaim_deadline_s=2")).start()
    procs += [agent, spawn_worker("job-a")]
    with agent.client() as c:
        reply = c.acquire("job-a", timeout_s=HUNG_FOR_MINUTES)
        status = c.status()
    eventually(lambda: not wedged.alive(), what="the wedged server stopped")
    assert good.alive() and good.sleeping(), "the server that behaved was left running, asleep"
    assert status["owner"] == "job:job-a" and status["ladder"].get("kill") == 1
    assert wedged.url in _yields(reply)[-1]["detail"] and good.url not in _yields(reply)[-1]["detail"]


# --------------------------------------------------------------------------- 3. an agent restart under a live holder


def test_a_client_reattaches_by_itself_after_an_agent_restart_and_keeps_the_gpu(tmp_path, procs):
    vllm = FakeVllmProc()
    worker = spawn_worker("job-a")
    extra = ("timeslice.agent.reattach_grace_s=3",)
    agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=extra).start()
    procs += [vllm, worker, agent]
    client = agent.client(connect_timeout_s=30)
    client.acquire("job-a")  # the trainer holds the GPU and computes; it makes no call during its step
    agent.kill(signal.SIGKILL)
    agent.start()

    def attached():
        job = agent.job("job-a")
        return job if job is not None and job["attached"] else None

    job = eventually(attached, what="the trainer's client reattached without a call of its own")
    assert job["holding"] and job["state"] == "RUNNING"
    assert not stopped(worker.pid) and vllm.sleeping(), "the holder was neither frozen nor the tenant woken"
    assert "came back and holds the GPU" in agent.log()
    client.release("job-a", wait=True)  # the step ends: the usual release, on the new connection
    eventually(lambda: stopped(worker.pid) and not vllm.sleeping(), what="the valley lent as usual")
    client.close()


def test_a_client_whose_agent_lost_its_record_gets_the_gpu_back_at_once(tmp_path, procs):
    """The new agent does not count the job as holding (its state file is gone): the client says it holds, and
    the agent yields the tenant and gives the GPU back, as for an acquire."""
    vllm = FakeVllmProc()
    worker = spawn_worker("job-a")
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    procs += [vllm, worker, agent]
    client = agent.client(connect_timeout_s=30)
    client.acquire("job-a")
    agent.kill(signal.SIGKILL)
    agent.state_file.unlink()
    agent.start()
    eventually(lambda: (j := agent.job("job-a")) is not None and j["holding"], what="the job holds the GPU again")
    assert vllm.sleeping() and not stopped(worker.pid)
    client.close()


# --------------------------------------------------------------------------- 4. the kill takes the registered process


@pytest.mark.parametrize("decoy_host", ["127.0.0.2", "::1"])
def test_a_tagged_server_on_another_address_with_the_same_port_is_never_killed(tmp_path, procs, decoy_host):
    if not _can_bind(decoy_host):
        pytest.skip(f"this machine cannot listen on {decoy_host}")
    port = _free_port()
    tenant = FakeVllmProc("--port", str(port), "--hang", "pause", tagged=True)
    decoy = FakeVllmProc("--host", decoy_host, "--port", str(port), tagged=True)
    procs += [tenant, decoy]
    agent = AgentProc(tmp_path, tenant_url=tenant.url, extra=("timeslice.tenant.reclaim_deadline_s=2",)).start()
    procs += [agent, spawn_worker("job-a")]
    with agent.client() as c:
        reply = c.acquire("job-a", timeout_s=HUNG_FOR_MINUTES)
    eventually(lambda: not tenant.alive(), what="the registered tenant stopped")
    assert decoy.alive(), "a process on another address is not the tenant"
    assert f"[{tenant.proc.pid}]" in _yields(reply)[-1]["detail"]


def test_a_listener_taken_over_after_registration_is_not_the_tenant(tmp_path, procs):
    port = _free_port()
    tenant = FakeVllmProc("--port", str(port), tagged=True)
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url, extra=("timeslice.tenant.reclaim_deadline_s=2",)).start()
    procs += [agent, spawn_worker("job-a")]
    tenant.post("/_standin/stop_listening")
    eventually(lambda: tenant_proc.find(tenant.url)[0] is None, what="the tenant's listener closed")
    assert proc_state(tenant.proc.pid) != "gone"
    decoy = FakeVllmProc("--port", str(port), "--hang", "pause", tagged=True)  # takes the port over
    procs.append(decoy)
    with agent.client() as c:
        c.acquire("job-a", timeout_s=HUNG_FOR_MINUTES)
    eventually(lambda: not tenant.alive(), what="the process registered as the tenant stopped")
    assert decoy.alive(), "the process that took the port over is not the registered tenant"


def test_a_call_is_never_kept_waiting_behind_the_clients_own_reconnect(tmp_path, procs):
    """The reader keeps trying to reach an agent that went away (the client has a job to reattach); a call made
    meanwhile still gives up after its own ``connect_timeout_s`` (it hung behind the reconnect's lock)."""
    from timeslice_verl.agent.client import AgentError

    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    client = agent.client(connect_timeout_s=0.5)
    client.prepare("job-a")  # the client has a job: it reconnects by itself once the agent is gone
    agent.kill(signal.SIGKILL)
    with pytest.raises(AgentError) as err:
        client.status()
    assert err.value.code == "unreachable"
    client.close()


# --------------------------------------------------------------------------- a hung tenant seen ahead


def test_a_tenant_that_stops_answering_while_lent_is_seen_wedged_and_reclaimed_by_the_kill_alone(tmp_path, procs):
    """SIGSTOP mid-valley (a hung server): the agent's probe marks it wedged before any trainer asks; the reclaim
    then skips the polite step (whose budget a stopped server would spend in full) and kills it."""
    tenant = FakeVllmProc(tagged=True)
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url, extra=("timeslice.tenant.reclaim_deadline_s=60",)).start()
    procs += [agent, spawn_worker("job-a")]
    os.kill(tenant.proc.pid, signal.SIGSTOP)
    seen = eventually(lambda: agent.status()["tenant"]["wedged"], what="the stopped tenant marked wedged")
    assert seen == [tenant.url] and "is wedged" in agent.log()
    with agent.client() as c:
        reply = c.acquire("job-a", timeout_s=HUNG_FOR_MINUTES)
        status = c.status()
    yielded = _yields(reply)[-1]
    assert "kill of a wedged tenant" in yielded["detail"] and not yielded["ok"]
    assert status["owner"] == "job:job-a" and status["ladder"].get("kill") == 1 and not status["ladder"].get("abort")
    assert tenant.proc.wait(30) == -signal.SIGKILL


# --------------------------------------------------------------------------- 5. a polite call given up on lands later


def test_a_pause_that_lands_after_the_polite_budget_is_seen_and_undone(tmp_path, procs):
    """The polite ``/pause`` answers (and takes effect) 4 s late, after its 1.8 s budget: the ladder aborts instead,
    the trainer holds and releases, the tenant is woken — and then the late pause lands. The agent's probe sees the
    tenant paused while it was counted awake, records it and wakes it again: what ``status`` says is what it is."""
    tenant = FakeVllmProc("--slow-s", "4", "--slow-on", "pause:keep")
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url, extra=("timeslice.tenant.reclaim_deadline_s=3",)).start()
    procs += [agent, spawn_worker("job-a")]
    with agent.client() as c:
        reply = c.acquire("job-a", timeout_s=HUNG_FOR_MINUTES)
        assert "abort" in _yields(reply)[-1]["detail"]
        c.release("job-a")

    def consistent() -> bool:
        st = tenant.stats()
        return (st["pauses"].get("keep", 0) >= 1 and not st["paused"] and not st["sleeping"]
                and agent.status()["tenant"]["state"] == "awake")

    eventually(consistent, what="the late pause landed and was undone, status awake")
    assert "asleep or paused while the agent counted it awake" in agent.log()


# --------------------------------------------------------------------------- 6. escalation on the deadline, not on errors


@pytest.mark.parametrize("fault", ["pause:1:500", "pause:2:garbage", "sleep:2:500"])
def test_errors_inside_the_polite_budget_are_retried_never_escalated(tmp_path, procs, fault):
    """With a 10 s deadline, one or two failed answers are retried within the polite step: no abort, no kill."""
    tenant = FakeVllmProc("--fail", fault, tagged=True)
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url, extra=("timeslice.tenant.reclaim_deadline_s=10",)).start()
    procs += [agent, spawn_worker("job-a")]
    with agent.client() as c:
        reply = c.acquire("job-a", timeout_s=HUNG_FOR_MINUTES)
        status = c.status()
    assert _yields(reply)[-1]["ok"], _yields(reply)
    assert not status["ladder"].get("abort") and not status["ladder"].get("kill"), status["ladder"]
    assert tenant.alive() and tenant.stats()["aborted"] == 0 and tenant.sleeping()


# --------------------------------------------------------------------------- 10. a state file in a shared directory


def test_a_state_file_in_a_directory_others_can_write_is_refused(tmp_path):
    """A root agent once loaded a planted state and stopped what it listed: the state's directory is checked as
    the socket's is, and the agent refuses to start, naming the key."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    agent = AgentProc(tmp_path, extra=(f"timeslice.agent.state_file={shared / 'agent-state.json'}",))
    code, out = agent.start_and_fail()
    assert code != 0 and "timeslice.agent.state_file" in out and "writable by others" in out


# --------------------------------------------------------------------------- 11. the low ones


def _float_keys(cls: type, prefix: str = "timeslice.") -> list[str]:
    import dataclasses

    from timeslice_verl.config import schema

    out = []
    for f in dataclasses.fields(cls):
        kind = eval(f.type, vars(schema)) if isinstance(f.type, str) else f.type
        if dataclasses.is_dataclass(kind):
            out += _float_keys(kind, f"{prefix}{f.name}.")
        elif kind is float:
            out.append(prefix + f.name)
    return out


def test_nan_and_infinity_are_refused_for_every_float_setting_naming_the_key():
    from timeslice_verl.config.overrides import compose
    from timeslice_verl.config.schema import ConfigError, TimesliceSettings

    keys = _float_keys(TimesliceSettings)
    assert "timeslice.tenant.reclaim_deadline_s" in keys and len(keys) >= 15
    for key in keys:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError, match=re.escape(key)):
                compose("interleave", [f"{key}={bad}"])


def test_a_prepare_with_a_30_day_ttl_keeps_the_tenant_asleep_only_briefly(tmp_path, procs):
    from timeslice_verl.agent.arbiter import MAX_PREPARE_TTL_S

    tenant = FakeVllmProc()
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url).start()
    procs.append(agent)
    with agent.client() as c:
        reply = c.prepare("job-never-acquires", ttl_s=30 * 86400)
    assert reply["accepted"] and reply["ttl_s"] == MAX_PREPARE_TTL_S <= 60, reply  # the tenant sleeps a minute at most
