"""The handoff's valleys: skipped releases, the way back ahead of need and what it hands the trainer's thread, and
the bounds the trainer's calls keep whatever the backlog source or the agent does (the items below are rows 7–9
and 11 of the ladder table in tests/reliability/README.md)."""

from __future__ import annotations

import threading

import pytest

from agent_support import eventually
from test_handoff import Agent, Calls, Ranks
from timeslice_verl.agent.client import AgentError
from timeslice_verl.handoff import sequence
from timeslice_verl.handoff.options import HandoffOptions
from timeslice_verl.handoff.sequence import Handoff


class SlowAgent(Agent):
    """An agent whose acquire waits (as behind another job) until a release of the job arrives or its time-out."""

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self.waiting: list[threading.Event] = []
        self.timeouts: list[float | None] = []
        self.ended_a_wait = False

    def acquire(self, job, timeout_s=None):
        self.calls("agent.acquire")
        self.timeouts.append(timeout_s)
        released = threading.Event()
        self.waiting.append(released)
        if released.wait(timeout_s if timeout_s is not None else 600):
            raise AgentError("busy", f"job {job!r} was released while waiting")
        raise AgentError("timeout", f"job {job!r} did not get the GPU within {timeout_s:g} s")

    def release(self, job, done=False, swap="checkpoint", parked=None):
        for released in self.waiting:  # as the agent does: a release ends the job's acquires that wait
            self.ended_a_wait = True
            released.set()
        self.waiting.clear()
        return super().release(job, done=done, swap=swap, parked=parked)


def _handoff(swap: str, backlog, *, agent: Agent | None = None, margin: float = 0.0, **options):
    calls = Calls()
    agent = agent or Agent(calls)
    agent.calls = calls
    h = Handoff("j", client=agent, ranks=Ranks(calls), backlog=backlog,
                options=HandoffOptions(swap=swap, break_even_margin=margin, **options))
    reports: list = []
    h.report = reports.append
    return h, calls, reports


def test_a_release_whose_next_batch_is_queued_is_skipped():
    h, calls, reports = _handoff("park", backlog=lambda: (8, 8), margin=1.5)
    out = h.release("weight_sync_end")
    assert out.action == "skip" and out.detail == "next batch queued (8/8 samples)"
    assert calls == [] and h.held, "no park, no agent call: the trainer keeps its GPU"
    assert h.acquire("pre_train_step") is None and calls == []
    assert [r.action for r in reports] == ["skip"]


def test_a_prepared_acquire_waits_for_nothing_and_the_trainers_thread_applies_what_the_way_back_did():
    backlog = [0, 20]
    h, calls, reports = _handoff("park", backlog=lambda: tuple(backlog))
    h.release("weight_sync_end")
    backlog[0] = 20  # the batch is complete: the way back is due now
    eventually(lambda: "unpark" in calls, what="the way back's acquire and unpark")
    assert not h.held and h.parked, "the way back owns nothing: the handoff's state is the trainer's thread's to change"
    before = list(calls)
    out = h.acquire("pre_train_step")
    assert calls == before, "the trainer's acquire called neither the agent nor the ranks"
    assert before[-2:] == ["agent.acquire", "unpark"]
    assert h.held and not h.parked and h.granted
    assert out.detail == "prepared ahead of need" and out.early_s >= 0
    assert [(r.action, r.point) for r in reports][-2:] == [("acquire", "prepare"), ("acquire", "pre_train_step")]
    assert reports[-2].at > 0, "the background acquire carries the time it happened"
    assert reports[-2].detail.startswith("20/20 samples") and reports[-2].detail.endswith("due"), \
        "the timeline says what the way back read when it fired"


@pytest.mark.parametrize("swap", ["checkpoint", "resident"])
def test_a_swap_that_parks_nothing_brings_the_gpu_back_by_the_agents_acquire_alone(swap):
    backlog = [20, 20]
    h, calls, reports = _handoff(swap, backlog=lambda: tuple(backlog))
    h.release("weight_sync_end")
    eventually(lambda: "agent.acquire" in calls, what="the way back's acquire")
    h.acquire("pre_train_step")
    assert calls.count("agent.acquire") == 1 and "unpark" not in calls


def test_a_way_back_not_yet_due_is_cancelled_by_the_acquire():
    h, calls, reports = _handoff("park", backlog=lambda: (0, 20000))
    h.release("weight_sync_end")
    h.acquire("pre_train_step")
    assert calls.count("agent.acquire") == 1
    assert calls[-4:] == ["agent.acquire", "agree:acquire", "unpark", "agree:unpark"], "the trainer's own acquire did it"


def test_a_backlog_source_that_blocks_never_holds_the_trainer(tmp_path):
    """Item 8: a source that blocks (a hung Ray actor) is read within a bound: the release decides without it and
    the acquire does not join a way back stuck inside a read."""
    gate = threading.Event()
    h, calls, reports = _handoff("park", backlog=lambda: gate.wait(3600) and (0, 16), margin=1.5)
    try:
        out = h.release("weight_sync_end")
        assert out.action == "release" and out.detail == "no backlog signal"
        h.acquire("pre_train_step")
        assert calls[-2:] == ["unpark", "agree:unpark"]
    finally:
        gate.set()


@pytest.mark.parametrize("value", [(1, 2, 3), ("1", "2"), (None, None), 7, (True, 16), (-1, 16), "queued"])
def test_a_backlog_of_the_wrong_shape_is_unknown_never_an_error(value):
    """Item 11: ``release`` promises not to raise; a source that answers nonsense is no backlog signal."""
    h, calls, reports = _handoff("park", backlog=lambda: value)
    assert h.release("weight_sync_end").action == "release"
    h.acquire("pre_train_step")


def test_the_acquire_waits_no_longer_than_its_bound_with_a_way_back_queued_behind_another_job():
    """Item 7: ``acquire_timeout_s`` bounds the trainer's whole wait: the way back's acquire counts against it,
    the trainer's own acquire gets only what is left (before, it got the whole bound again)."""
    calls = Calls()
    agent = SlowAgent(calls)
    h, calls, reports = _handoff("park", backlog=lambda: (16, 16), agent=agent, acquire_timeout_s=0.5)
    h.release("weight_sync_end")
    eventually(lambda: agent.timeouts, what="the way back's acquire")
    with pytest.raises(AgentError) as err:
        h.acquire("pre_train_step")
    assert err.value.code == "timeout"
    assert agent.timeouts[0] == 0.5 and all(t < 0.5 for t in agent.timeouts[1:]), agent.timeouts
    assert h.parked, "no rank unparks without the GPU"


def test_a_crash_with_a_way_back_stuck_behind_another_job_is_bounded(monkeypatch):
    """Item 9: the crash waits for the way back only as long as its bound, then releases — which ends the way
    back's acquire at the agent — and leaves the ranks as they are (no CUDA call on a process that may be locked)."""
    monkeypatch.setattr(sequence, "FINAL_ACQUIRE_TIMEOUT_S", 0.3)
    calls = Calls()
    agent = SlowAgent(calls)
    h, calls, reports = _handoff("park", backlog=lambda: (16, 16), agent=agent)
    h.release("weight_sync_end")
    eventually(lambda: agent.timeouts, what="the way back's acquire, waiting")
    out = h.crash("exception:fit")
    assert out.action == "crash_release" and agent.ended_a_wait, "the crash's release ended the way back's acquire"
    assert calls.count("unpark") == 0 and h.parked


def test_a_handoff_built_from_settings_honours_every_handoff_key():
    from timeslice_verl.config.overrides import compose

    settings = compose("interleave", ["timeslice.handoff.break_even_margin=2.5", "timeslice.handoff.prepare=false",
                                      "timeslice.handoff.prepare_lead_s=0.7", "timeslice.handoff.late_cost=9",
                                      "timeslice.handoff.acquire_timeout_s=12", "timeslice.handoff.swap=park"])
    h = Handoff.from_settings(settings, client=None, ranks=Ranks(Calls()))
    o = h.options
    assert (o.break_even_margin, o.prepare, o.prepare_lead_s, o.late_cost, o.acquire_timeout_s, o.swap) == \
        (2.5, False, 0.7, 9.0, 12.0, "park")
    assert (h.forecast.margin, h.forecast.lead_s, h.forecast.late_cost) == (2.5, 0.7, 9.0)
