"""Swap modes (``timeslice.handoff.swap``): the control path of park and park+checkpoint against a real
agent (CPU test backend), with stand-in workers that record when they park and unpark.

On this backend a lock does nothing and a checkpoint stops the process (SIGSTOP), so what the agent
did to a worker is visible in ``/proc``: after a ``park`` release the worker keeps running (locked
only), after ``park+checkpoint`` it is stopped.
"""

from __future__ import annotations

import time

import pytest

from agent_support import AgentProc, FakeVllmProc, agent_with_a_tenant_per_gpu, eventually, spawn_worker, stopped
from timeslice_verl import hookimpl
from timeslice_verl.agent.client import AgentError
from timeslice_verl.config.schema import ConfigError
from timeslice_verl.config.overrides import compose
from timeslice_verl.testing import RecordingPlugin, fake_event_sequence, make_lifecycle, play

BUNDLED = ("agent", "timeline", "metrics")

GIB = 2**30


class FakeWorkers:
    """verl's worker groups as the agent plugin sees them (``lifecycle.workers``), one rank."""

    def __init__(self, pid: int, *, fail_park: bool = False, fail_unpark: int = 0) -> None:
        self.pid = pid
        self.fail_park = fail_park
        self.fail_unpark = fail_unpark
        self.calls: list[tuple[str, float, bool]] = []
        """(method, time, whether the worker process was stopped at that moment)."""
        self.parked = False

    def _log(self, name: str) -> None:
        self.calls.append((name, time.time(), stopped(self.pid)))

    def can_park(self) -> bool:
        return True

    def local_pids(self) -> list[int]:
        return [self.pid]

    def release_caches(self) -> list[dict]:
        self._log("release_caches")
        return []

    def park_reserve(self) -> list[dict]:
        self._log("park_reserve")
        return [{"pid": self.pid, "pinned": GIB}]

    def park(self) -> list[dict]:
        self._log("park")
        self.parked = True  # as far as the ranks that got to it are concerned
        if self.fail_park:
            raise RuntimeError("rank 1: park: CUDA error: out of memory")
        return [{"pid": self.pid, "parked": GIB, "kept": 0, "seconds": 0.02}]

    def unpark(self) -> list[dict]:
        self._log("unpark")
        assert not stopped(self.pid), "unpark ran while the agent still had the worker frozen"
        if self.fail_unpark:
            self.fail_unpark -= 1
            raise RuntimeError("rank 0: unpark: CUDA error: out of memory")
        self.parked = False
        return [{"pid": self.pid, "parked": GIB, "kept": 0, "seconds": 0.02}]


class ValleyProbe:
    """At each rollout (the trainer's idle valley) wait for the agent to settle and record the worker's state."""

    name = "valley-probe"

    def __init__(self, agent: AgentProc, pid: int, expect_stopped: bool) -> None:
        self.agent, self.pid, self.expect_stopped = agent, pid, expect_stopped
        self.seen: list[tuple[str, bool]] = []

    @hookimpl(trylast=True)
    def post_rollout(self) -> None:
        eventually(lambda: (self.agent.job("swap-job") or {}).get("state") == "FROZEN", what="the agent froze the job")
        if self.expect_stopped:
            eventually(lambda: stopped(self.pid), what="checkpoint stopped the worker")
        self.seen.append((self.agent.job("swap-job")["state"], stopped(self.pid)))


@pytest.fixture
def node(tmp_path, procs):
    vllm = FakeVllmProc()
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    worker = spawn_worker("swap-job")
    procs.extend([vllm, agent, worker])
    return tmp_path, agent, vllm, worker


def lifecycle(tmp_path, agent, workers, swap: str, *plugins):
    settings = compose("interleave", [
        "timeslice.job=swap-job", f"timeslice.agent.socket={agent.socket}", "timeslice.tenant.url=",
        f"timeslice.timeline.path={tmp_path / 'run.jsonl'}", "timeslice.handoff.prepare=false",
        f"timeslice.handoff.swap={swap}", "timeslice.handoff.break_even_margin=0",  # scripted valleys: lend them all
    ])
    lc = make_lifecycle(*plugins, settings=settings, load_installed=True, bundled=BUNDLED)
    lc.ranks = workers
    return lc


def _freezes(recorder) -> list:
    return [t for e in recorder.events("handoff") for t in e.transitions if t.action == "freeze"]


@pytest.mark.parametrize("swap, checkpointed", [("park", False), ("park+checkpoint", True)])
def test_workers_park_before_the_agent_freezes_and_unpark_after_it_thaws(node, swap, checkpointed):
    tmp_path, agent, vllm, worker = node
    workers = FakeWorkers(worker.pid)
    recorder, probe = RecordingPlugin(), ValleyProbe(agent, worker.pid, expect_stopped=checkpointed)
    play(lifecycle(tmp_path, agent, workers, swap, recorder, probe), fake_event_sequence(3))

    names = [c[0] for c in workers.calls]
    assert names[:2] == ["release_caches", "park_reserve"], \
        "at init_workers_end the ranks say what they hold (the round trip's estimate), then pin once, before any park"
    assert names.count("park_reserve") == 1 and names.count("release_caches") == 1, "no cache release in a park swap"
    assert names[2:] == ["park", "unpark"] * (names.count("park")), names
    # every valley: the job frozen; the worker stopped only when its remainder was checkpointed
    assert probe.seen and all(state == "FROZEN" and frozen == checkpointed for state, frozen in probe.seen)
    freezes = _freezes(recorder)
    assert freezes and all(("locked only" in t.detail) != checkpointed and "parked 1.00 GiB" in t.detail for t in freezes)
    # ordering: each park ended before the agent's freeze began; each unpark began after the thaw ended
    parks = [t for n, t, _ in workers.calls if n == "park"]
    unparks = [t for n, t, _ in workers.calls if n == "unpark"]
    thaws = [t for e in recorder.events("handoff") for t in e.transitions if t.action == "thaw"]
    assert all(any(p <= f.start for p in parks) for f in freezes)
    assert all(any(u >= t.end for u in unparks) for t in thaws)
    releases = [e for e in recorder.events("handoff") if e.action == "release" and e.point != "timeslice_stop"]
    assert all(e.swap == swap and e.parked_bytes == GIB for e in releases)
    eventually(lambda: agent.job("swap-job") is None and not vllm.sleeping(), what="the job ended, vLLM serves")
    assert not workers.parked and not stopped(worker.pid)


def test_a_crash_while_parked_gives_the_workers_their_memory_back_and_the_gpu_to_the_tenant(node):
    tmp_path, agent, vllm, worker = node
    workers = FakeWorkers(worker.pid)
    recorder = RecordingPlugin()
    play(lifecycle(tmp_path, agent, workers, "park+checkpoint", recorder), fake_event_sequence(3, crash_at=2))
    names = [c[0] for c in workers.calls]
    assert names[-1] == "unpark" and not workers.parked, "the last thing the workers did was take their tensors back"
    assert any(e.action == "crash_release" for e in recorder.events("handoff"))
    eventually(lambda: agent.job("swap-job") is None and not vllm.sleeping(), what="GPU back with the tenant")
    assert not stopped(worker.pid)


@pytest.mark.parametrize("fail_unpark", [0, 1])
def test_a_park_that_fails_keeps_the_gpu_and_leaves_nothing_parked(node, fail_unpark):
    tmp_path, agent, vllm, worker = node
    workers = FakeWorkers(worker.pid, fail_park=True, fail_unpark=fail_unpark)
    recorder = RecordingPlugin()
    play(lifecycle(tmp_path, agent, workers, "park", recorder), fake_event_sequence(2))
    assert not _freezes(recorder), "the agent was never asked to lend the GPU"
    assert all(e.action != "release" or e.point == "timeslice_stop" for e in recorder.events("handoff"))
    names = [c[0] for c in workers.calls]
    assert names.count("unpark") >= names.count("park") + fail_unpark, "ranks that parked were brought back"
    assert not workers.parked, "an unpark that failed is retried before the next step touches the GPU"


def test_the_swap_setting_is_checked_and_needs_workers_that_park(tmp_path):
    with pytest.raises(ConfigError, match="timeslice.handoff.swap"):
        compose("interleave", ["timeslice.handoff.swap=parking"])
    assert str(compose("interleave", ["timeslice.handoff.swap=park+checkpoint"]).handoff.swap) == "park+checkpoint"
    settings = compose("interleave", ["timeslice.handoff.swap=park", f"timeslice.agent.socket={tmp_path / 'none.sock'}"])
    lc = make_lifecycle(settings=settings, load_installed=True, bundled=BUNDLED)  # no workers: a trainer without verl's groups
    with pytest.raises(ValueError, match="swap=park needs trainer ranks"):
        lc.start()


def test_the_agent_checks_what_a_park_release_carries(agent):
    with agent.client() as c:
        c.acquire("j")
        for bad, field in (
            ({"swap": "parked"}, "'swap'"),
            ({"swap": "park"}, "needs 'parked'"),
            ({"swap": "park", "parked": [{"pid": 1}]}, "'parked'"),
            ({"swap": "park", "parked": [{"pid": 123, "parked": -1, "kept": 0}]}, "'parked'"),
        ):
            with pytest.raises(AgentError, match=field):
                c.call("release", job="j", **bad)
        assert agent.job("j")["holding"], "a refused release changes nothing"
        c.release("j", swap="park", parked=[{"pid": 4242, "parked": GIB, "kept": 0}])
        assert not agent.job("j")["holding"]


def test_one_agent_puts_a_tenant_per_gpu_to_sleep_and_wakes_them_together(tmp_path, procs):
    agent, tenants = agent_with_a_tenant_per_gpu(tmp_path, procs)
    assert agent.status()["tenant"]["urls"] == [t.url for t in tenants]
    with agent.client() as c:
        c.acquire("two-gpus")
        assert all(t.sleeping() for t in tenants)
        c.release("two-gpus", wait=True)
        eventually(lambda: not any(t.sleeping() for t in tenants), what="both tenants awake")


def test_a_dead_server_never_leaves_its_peers_asleep_and_rejoins_the_group_when_back(tmp_path, procs):
    agent, tenants = agent_with_a_tenant_per_gpu(tmp_path, procs)
    port = tenants[1].url.rsplit(":", 1)[1]
    tenants[1].stop()  # one server dies: the other still yields and wakes, a trainer is never kept waiting
    with agent.client() as c:
        c.acquire("two-gpus", timeout_s=30)
        assert tenants[0].sleeping()
        c.release("two-gpus")
        eventually(lambda: not tenants[0].sleeping(), timeout=10, what="the live server woken although its peer is dead")
        assert tenants[1].url in agent.status()["tenant"]["error"]
        c.acquire("two-gpus", timeout_s=30)
        assert tenants[0].sleeping()
        back = FakeVllmProc("--port", port)  # restarted, awake, on a GPU the trainer holds
        procs.append(back)
        # its own supervisor (`tenant run` of that one server) registers it: a member of the group, not a conflict
        member = c.register_tenant([back.url], supervisor={"pid": back.proc.pid, "restarts": 1})
        assert member["member"] == [back.url] and member["urls"] == [t.url for t in tenants], member
        assert agent.status()["tenant"]["supervisor"]["urls"] == [back.url]
        with pytest.raises(AgentError, match="already registered"):  # a server outside the group still is one
            c.register_tenant(["http://127.0.0.1:9"])
        eventually(back.sleeping, timeout=15, what="the restarted server put to sleep with its group")
        # the server sleeps before the agent's revive returns and clears the note: wait for the agent's own word
        eventually(lambda: agent.status()["tenant"]["error"] == "", what="the group whole again in the status")
        c.release("two-gpus")
        eventually(lambda: not tenants[0].sleeping() and not back.sleeping(), timeout=10, what="both awake again")
    assert "answers again and follows the group: asleep" in agent.log()


class TwoRanks(FakeWorkers):
    """verl's worker groups with two ranks on the node (``trainer.n_gpus_per_node=2``)."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(pids[0])
        self.pids = pids

    def local_pids(self) -> list[int]:
        return list(self.pids)

    def park_reserve(self) -> list[dict]:
        return [{"pid": p, "pinned": GIB} for p in self.pids]

    def park(self) -> list[dict]:
        self.parked = True
        return [{"pid": p, "parked": GIB, "kept": 0, "seconds": 0.02} for p in self.pids]

    def unpark(self) -> list[dict]:
        assert not any(stopped(p) for p in self.pids), "unpark ran while a rank was still frozen"
        self.parked = False
        return [{"pid": p, "parked": GIB, "kept": 0, "seconds": 0.02} for p in self.pids]


class EveryGpu:
    """Records, in each valley and each step, whether every rank is stopped and every tenant asleep."""

    name = "every-gpu"

    def __init__(self, agent: AgentProc, pids: list[int], tenants: list) -> None:
        self.agent, self.pids, self.tenants = agent, pids, tenants
        self.valleys: list[tuple[bool, bool]] = []
        self.steps: list[tuple[bool, bool]] = []

    @hookimpl(trylast=True)
    def post_rollout(self) -> None:
        eventually(lambda: all(stopped(p) for p in self.pids) and not any(t.sleeping() for t in self.tenants),
                   timeout=10, what="both ranks frozen and both tenants serving")
        self.valleys.append((all(stopped(p) for p in self.pids), not any(t.sleeping() for t in self.tenants)))

    @hookimpl(trylast=True)
    def pre_train_step(self) -> None:  # after the agent plugin's acquire returned
        self.steps.append((not any(stopped(p) for p in self.pids), all(t.sleeping() for t in self.tenants)))


def test_verls_ranks_on_two_gpus_are_frozen_and_given_back_together_with_a_tenant_per_gpu(tmp_path, procs):
    agent, tenants = agent_with_a_tenant_per_gpu(tmp_path, procs)
    ranks = [spawn_worker("swap-job") for _ in range(2)]
    procs.extend(ranks)
    pids = [r.pid for r in ranks]
    probe = EveryGpu(agent, pids, tenants)
    play(lifecycle(tmp_path, agent, TwoRanks(pids), "park+checkpoint", probe), fake_event_sequence(3))
    assert probe.valleys == [(True, True)] * 3, "in every valley: both ranks frozen, both tenants serving"
    assert probe.steps == [(True, True)] * 3, "in every step: both ranks running, both tenants asleep"
    eventually(lambda: agent.job("swap-job") is None and not any(t.sleeping() for t in tenants), what="run over")


def test_a_server_rejoining_the_group_never_delays_the_trainer(tmp_path, procs):
    # a hanging call would hold the agent for 10 minutes: far past the acquire's own timeout below
    agent, tenants = agent_with_a_tenant_per_gpu(tmp_path, procs, extra=("timeslice.tenant.request_timeout_s=600",))
    port = tenants[1].url.rsplit(":", 1)[1]
    tenants[1].stop()
    with agent.client() as c:
        c.acquire("two-gpus", timeout_s=30)
        c.release("two-gpus")
        eventually(lambda: not tenants[0].sleeping(), timeout=10, what="the group awake without its dead server")
        back = FakeVllmProc("--port", port, "--asleep", "--hang", "wake_up")  # comes back asleep; waking it hangs
        procs.append(back)
        eventually(lambda: agent.status()["transition"] == "tenant revive", timeout=15, what="the agent waking it")
        c.acquire("two-gpus", timeout_s=120)  # the trainer does not wait for a rejoining server's hanging wake-up
        assert tenants[0].sleeping() and back.sleeping()
