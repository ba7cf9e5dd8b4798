"""The reclaim ladder: the trainer gets its GPU back whatever the tenant does (polite → abort → kill).

Real processes: the agent daemon (CPU test backend), a tagged job worker, a stand-in vLLM with a fault
injected. The bound itself (acquire within the deadline + 1 s) is measured by ``benchmarks/ladder.py``;
here a client-side time-out only ends a test that would hang (each fault would hold the trainer for
minutes without the ladder).
"""

from __future__ import annotations

import pytest

from agent_support import AgentProc, FakeVllmProc, eventually, proc_state, spawn_worker
from timeslice_verl.agent.tenant import proc as tenant_proc
from timeslice_verl.agent.tenant.ladder import budgets

DEADLINE = "timeslice.tenant.reclaim_deadline_s=2"
HUNG_FOR_MINUTES = 60.0
"""The client's acquire time-out: far beyond the deadline, far below what a hung tenant would cost."""


@pytest.mark.parametrize(
    ("deadline", "polite", "abort", "kill"),
    [
        (10.0, 6.0, 2.0, 2.0),
        (2.0, 1.0, 0.5, 0.5),
        (0.4, 0.2, 0.1, 0.1),
        (0.0, None, 2.0, 2.0),  # no deadline: the polite step waits as long as the tenant's time-outs allow
    ],
)
def test_budgets_split_the_deadline(deadline, polite, abort, kill):
    b = budgets(deadline)
    assert (b.polite_s, b.abort_s, b.kill_s) == (pytest.approx(polite) if polite else None, abort, kill)
    if deadline:
        assert b.polite_s + b.abort_s + b.kill_s == pytest.approx(deadline)


def _setup(tmp_path, procs, *fault: str, tagged: bool = True, awake: bool = True):
    vllm = FakeVllmProc(*fault, tagged=tagged)
    procs.append(vllm)
    agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=(DEADLINE,)).start()
    procs.append(agent)
    worker = spawn_worker("job-a")
    procs.append(worker)
    # the agent takes the tenant at its first answer; a slow one under load may answer after the agent's start
    if awake:
        eventually(lambda: agent.status()["tenant"]["state"] == "awake", what="the agent seeing the tenant awake",
                   timeout=HUNG_FOR_MINUTES)
    return vllm, agent


def _acquire(agent):
    """The trainer asks for its GPU while the tenant is awake: the yield goes down the ladder if it must."""
    with agent.client() as c:
        reply = c.acquire("job-a", timeout_s=HUNG_FOR_MINUTES)
        status = c.status()
    yields = [t for t in reply["transitions"] if t["action"] == "tenant_yield"]
    return reply, yields, status


@pytest.mark.parametrize(
    ("fault", "step"),
    [
        (("--hang", "pause"), "kill"),  # a wedged engine: neither pause answers
        (("--hang", "sleep"), "kill"),  # pauses, then never sleeps
        (("--slow-s", "1.5"), "kill"),  # every control call answers 1.5 s late: no step fits its budget
    ],
)
def test_a_tenant_that_does_not_give_the_gpu_back_is_killed_and_reported(tmp_path, procs, fault, step):
    vllm, agent = _setup(tmp_path, procs, *fault)
    reply, yields, status = _acquire(agent)
    assert yields and not yields[-1]["ok"] and "ladder: kill" in yields[-1]["detail"], yields
    assert "SIGKILL" in yields[-1]["detail"]
    assert status["ladder"].get(step) == 1 and "kill" in status["ladder"]["last"]
    assert status["owner"] == "job:job-a"
    assert status["tenant"]["state"] == "dead"
    eventually(lambda: not vllm.alive(), what="the tagged tenant stopped")


def test_abort_step_keeps_the_tenant_and_brings_it_back(tmp_path, procs):
    """Only the polite pause hangs: aborting the requests in flight is enough; the tenant sleeps and is woken
    again after the release (no kill)."""
    vllm, agent = _setup(tmp_path, procs, "--hang", "pause:keep")
    reply, yields, status = _acquire(agent)
    assert yields[-1]["ok"] and yields[-1]["detail"].startswith("ladder: abort"), yields
    assert set(yields[-1]["phases"]) == {"polite", "abort"}
    assert status["ladder"].get("abort") == 1 and "kill" not in status["ladder"]
    assert vllm.alive() and vllm.sleeping()
    with agent.client() as c:
        c.release("job-a", wait=True)
    eventually(lambda: not vllm.sleeping(), what="the tenant woken after the release")
    assert vllm.alive()


def test_a_tenant_that_dies_mid_yield_leaves_the_trainer_its_gpu(tmp_path, procs):
    vllm, agent = _setup(tmp_path, procs, "--die-on", "pause")
    reply, yields, status = _acquire(agent)
    assert yields and not yields[-1]["ok"] and "does not answer" in yields[-1]["detail"]
    assert status["owner"] == "job:job-a" and status["tenant"]["state"] == "dead"
    assert "kill" not in status["ladder"], "a dead server needs no ladder"


def test_a_hanging_health_check_never_delays_the_trainer(tmp_path, procs):
    """Neither the agent's start nor the trainer waits on it: the tenant is taken for dead and retried."""
    vllm, agent = _setup(tmp_path, procs, "--hang", "health", awake=False)
    reply, yields, status = _acquire(agent)
    assert status["owner"] == "job:job-a" and status["tenant"]["state"] == "dead"
    assert "no answer" in status["tenant"]["error"] and not status["ladder"]["last"]


def test_an_untagged_tenant_is_never_killed(tmp_path, procs):
    """Without TIMESLICE_TENANT in its environment the server is left alone: the ladder ends at abort,
    the tenant is reported dead, and the trainer still gets its GPU."""
    vllm, agent = _setup(tmp_path, procs, "--hang", "pause", tagged=False)
    reply, yields, status = _acquire(agent)
    assert "nothing stopped" in yields[-1]["detail"] and "is not tagged TIMESLICE_TENANT" in yields[-1]["detail"], yields
    assert status["owner"] == "job:job-a" and status["tenant"]["state"] == "dead"
    assert vllm.alive()


def test_the_kill_takes_what_the_tagged_server_started(tmp_path, procs):
    """vLLM's engine core (the process that holds the GPU memory) is the server's child: it goes too."""
    vllm, agent = _setup(tmp_path, procs, "--hang", "pause", "--engine-child")
    child = vllm.stats()["child_pid"]
    found, _ = tenant_proc.find(vllm.url)
    assert tenant_proc.stoppable(found)[0] == [vllm.proc.pid, child]
    reply, yields, status = _acquire(agent)
    assert "SIGKILL to 2 process(es)" in yields[-1]["detail"], yields
    eventually(lambda: proc_state(child) in ("gone", "Z"), what="the engine child stopped")


def test_the_kill_may_stop_the_listener_only_when_tagged(procs):
    tagged, untagged = FakeVllmProc(tagged=True), FakeVllmProc()
    procs.extend([tagged, untagged])
    found, why = tenant_proc.find(tagged.url)
    assert found is not None and found.pid == tagged.proc.pid and found.tagged, why
    assert tenant_proc.stoppable(found) == ([tagged.proc.pid], "")
    pids, why = tenant_proc.stoppable(tenant_proc.find(untagged.url)[0])
    assert pids == [] and f"pid {untagged.proc.pid} is not tagged TIMESLICE_TENANT" in why
    assert tenant_proc.find("http://127.0.0.1:1")[0] is None
