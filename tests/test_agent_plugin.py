"""The bundled agent plugin against a real agent process (CPU test backend), and its way back ahead of need."""

from __future__ import annotations

import threading

import pytest

from agent_support import AgentProc, FakeVllmProc, eventually, spawn_worker, stopped
from timeslice_verl import hookimpl
from timeslice_verl.config.overrides import compose
from timeslice_verl.testing import RecordingPlugin, fake_event_sequence, make_lifecycle, play

BUNDLED = ("agent", "timeline", "metrics")


class Observer:
    """Runs after the agent plugin (trylast) and records what the GPU looked like then."""

    name = "observer"

    def __init__(self, agent: AgentProc, vllm: FakeVllmProc, worker_pid: int) -> None:
        self.agent, self.vllm, self.pid = agent, vllm, worker_pid
        self.seen: list[tuple[str, str, bool, bool]] = []

    def _look(self, hook: str) -> None:
        status = self.agent.status()
        self.seen.append((hook, status["owner"], stopped(self.pid), self.vllm.sleeping()))

    @hookimpl(trylast=True)
    def pre_train_step(self) -> None:
        self._look("pre_train_step")

    @hookimpl(trylast=True)
    def save_checkpoint_begin(self) -> None:
        self._look("save_checkpoint_begin")

    @hookimpl(trylast=True)
    def init_workers_begin(self) -> None:
        self._look("init_workers_begin")


@pytest.fixture
def setup(tmp_path):
    vllm = FakeVllmProc()
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    worker = spawn_worker("plugin-job")
    yield tmp_path, agent, vllm, worker
    worker.kill()
    agent.stop()
    vllm.stop()


def lifecycle_for(tmp_path, agent, *plugins, prepare: bool = False):
    settings = compose("interleave", [
        "timeslice.job=plugin-job", f"timeslice.agent.socket={agent.socket}", "timeslice.tenant.url=",
        f"timeslice.timeline.path={tmp_path / 'run.jsonl'}", f"timeslice.handoff.prepare={str(prepare).lower()}",
        "timeslice.handoff.break_even_margin=0",  # a scripted sequence's valleys last no time: lend every one
    ])
    return make_lifecycle(*plugins, settings=settings, load_installed=True, bundled=BUNDLED)


def test_full_event_sequence_with_a_save_drives_the_agent(setup):
    tmp_path, agent, vllm, worker = setup
    recorder = RecordingPlugin()
    observer = Observer(agent, vllm, worker.pid)
    lc = lifecycle_for(tmp_path, agent, recorder, observer)
    play(lc, fake_event_sequence(3, save_at=(2,)))

    handoffs = [(e.action, e.point) for e in recorder.events("handoff")]
    assert handoffs == [
        ("acquire", "init_workers_begin"), ("release", "init_workers_end"),
        ("acquire", "weight_sync_begin"), ("release", "weight_sync_end"),  # the pre-fit sync
        ("acquire", "pre_train_step"), ("release", "weight_sync_end"),
        ("acquire", "pre_train_step"), ("release", "save_checkpoint_end"),  # held through the step's save
        ("acquire", "pre_train_step"), ("release", "weight_sync_end"),
        ("release", "timeslice_stop"),
    ]
    # whenever a gating hook returned, the trainer owned the GPU: worker running, vLLM asleep
    assert observer.seen and all(owner == "job:plugin-job" and not frozen and asleep for _, owner, frozen, asleep in observer.seen)
    # the save was allowed; after the run the job is forgotten (its workers exit: nothing to freeze) and vLLM serves again
    saves = recorder.events("save_checkpoint_end")
    assert len(saves) == 1 and saves[0].saved
    eventually(lambda: not vllm.sleeping() and agent.job("plugin-job") is None, what="job forgotten, vLLM awake after the run")
    assert not stopped(worker.pid), "an ended job's processes are never frozen"
    # restores after the first one are reported with their transitions
    acquires = [e for e in recorder.events("handoff") if e.action == "acquire"]
    assert any(t.action == "thaw" for e in acquires for t in e.transitions)
    assert all(e.ok for e in recorder.events("handoff"))


def test_an_exception_crash_releases(setup):
    tmp_path, agent, vllm, worker = setup
    recorder = RecordingPlugin()
    lc = lifecycle_for(tmp_path, agent, recorder)
    play(lc, fake_event_sequence(3, crash_at=2))
    actions = [(e.action, e.point) for e in recorder.events("handoff")]
    assert actions[-2] == ("crash_release", "exception:fit")
    assert recorder.names.count("trainer_exception") == 1
    # the run is over: the job is forgotten (its workers are torn down, nothing to freeze) and vLLM wakes
    eventually(lambda: agent.job("plugin-job") is None and not vllm.sleeping(), what="crash-release woke vLLM")
    assert not stopped(worker.pid)


def test_acquire_failure_stops_the_trainer(tmp_path):
    settings = compose("interleave", ["timeslice.job=x", f"timeslice.agent.socket={tmp_path / 'none.sock'}",
                                      "timeslice.agent.connect_timeout_s=0.2", "timeslice.tenant.url="])
    lc = make_lifecycle(settings=settings, load_installed=True, bundled=BUNDLED)
    with pytest.raises(Exception, match="no timeslice agent answers"):
        lc.start()


def test_the_way_back_thaws_the_trainer_before_it_asks_and_the_trainer_reports_it(setup):
    """The backlog says the batch is complete while the trainer's GPU is lent: the way back acquires it in the
    background (the agent thaws the worker and puts the tenant to sleep), so the trainer's acquire waits for nothing.
    The background acquire is reported by the trainer's own thread, with the time it happened."""
    tmp_path, agent, vllm, worker = setup
    recorder = RecordingPlugin()
    lc = lifecycle_for(tmp_path, agent, recorder, prepare=True)
    backlog = [0, 8]  # (queued, required), as the adapters read verl's queue
    lc.backlog = lambda: tuple(backlog)
    lc.start()
    from timeslice_verl.hooks.events import TrainStepEvent, WeightSyncEvent

    lc.pre_train_step(lc.event(TrainStepEvent))
    lc.weight_sync_end(lc.event(WeightSyncEvent, synced=True))  # released: the valley begins
    eventually(lambda: stopped(worker.pid) and not vllm.sleeping(), what="the worker frozen, the tenant serving")
    backlog[0] = 8  # the batch is complete
    eventually(lambda: not stopped(worker.pid) and vllm.sleeping(), what="the way back thawed it before the trainer asked")
    # its figures are stamped when the agent's answer is in: once its thread has ended (never compared with the agent)
    eventually(lambda: not any(t.name == "timeslice-wayback" for t in threading.enumerate()), what="the way back done")
    assert not [e for e in recorder.events("handoff") if e.point == "prepare"], "reported by the trainer's thread only"
    asked = lc.event(TrainStepEvent).time
    lc.pre_train_step(lc.event(TrainStepEvent))
    background, prepared = [e for e in recorder.events("handoff") if e.action == "acquire"][-2:]
    assert background.point == "prepare" and background.time < asked, "the background acquire keeps its own time"
    assert prepared.detail == "prepared ahead of need" and prepared.early_s > 0
    assert not any(t.action == "thaw" for t in prepared.transitions), "the trainer's acquire thawed nothing"
    lc.stop()
