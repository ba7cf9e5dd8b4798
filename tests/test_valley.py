"""Whether a valley pays, and when the way back starts: the pure forecast, then the handoff that uses it."""

from __future__ import annotations

import pytest

from agent_support import eventually
from test_handoff import Agent, Calls, Ranks
from timeslice_verl.handoff import Handoff
from timeslice_verl.valley import ValleyForecast


def learned(margin: float = 1.5, per_sample_s: float = 0.1, round_trip_s: float = 1.0, lead_s: float = 0.5) -> ValleyForecast:
    """A forecast that has seen one valley: 10 samples missing took 10 × ``per_sample_s``."""
    f = ValleyForecast(lead_s=lead_s, margin=margin)
    f.decide((0, 10))
    f.observe_wait(10 * per_sample_s)
    f.observe_round_trip(round_trip_s)
    return f


@pytest.mark.parametrize(
    ("forecast", "backlog", "release", "reason"),
    [
        (ValleyForecast(), None, True, "no backlog signal"),
        (ValleyForecast(), (8, 8), False, "next batch queued (8/8 samples)"),
        (ValleyForecast(), (9, 8), False, "next batch queued (9/8 samples)"),
        (ValleyForecast(), (0, 8), True, "learning the valleys"),
        (learned(), (15, 20), False, "valley 0.50 s expected (15/20 samples) < 1.5 × round trip 1.00 s"),
        (learned(), (0, 20), True, "valley 2.00 s expected ≥ 1.5 × round trip 1.00 s"),
        (learned(margin=3.0), (0, 20), False, "valley 2.00 s expected (0/20 samples) < 3 × round trip 1.00 s"),
        (learned(margin=0.0), (20, 20), True, "every valley is lent (break_even_margin=0)"),
    ],
)
def test_decide(forecast, backlog, release, reason):
    d = forecast.decide(backlog)
    assert (d.release, d.reason) == (release, reason)


@pytest.mark.parametrize(
    ("forecast", "backlog", "due"),
    [
        (ValleyForecast(), (0, 20), None),  # no way back measured yet: nothing to time it by
        (learned(), (0, 20), 1.5),  # 20 missing × 0.1 s - lead 0.5 s
        (learned(), (16, 20), 0.0),  # 0.4 s left < lead: start now
        (learned(), None, 0.5),  # no backlog: the shortest queue wait (1.0 s) - lead
        (learned(lead_s=0.0), (0, 20), 2.0),  # no lead set and no way back measured: starts at the valley's end
    ],
)
def test_due_in(forecast, backlog, due):
    if forecast.lead_s == 0 and forecast.round_trips:
        forecast.observe_thaw(1e-9)  # a way back measured as instant
    assert forecast.due_in(backlog) == (pytest.approx(due) if due is not None else None)


@pytest.mark.parametrize(
    ("per_sample_s", "backlog", "since_s", "due"),
    [
        (0.1, (19, 20), 0.0, 0.0),  # 0.1 s left < lead 0.5 s: now
        (2.0, (19, 20), 0.0, 1.5),  # one sample 2 s apart, just begun: 2 - 0.5
        (2.0, (19, 20), 1.2, 0.3),  # the same sample 1.2 s along: 0.8 s left - 0.5
        (2.0, (19, 20), 5.0, 0.0),  # overdue: now, never negative
        (2.0, (17, 20), 1.0, 4.5),  # 3 missing: 6 s - 1 s along - 0.5
        (2.0, (20, 20), 9.0, 0.0),  # complete
    ],
)
def test_due_in_counts_how_far_along_the_next_sample_is(per_sample_s, backlog, since_s, due):
    """Samples of long responses come seconds apart: the time the backlog has stood still is progress."""
    forecast = learned(per_sample_s=per_sample_s)
    assert forecast.due_in(backlog, since_s=since_s) == pytest.approx(due)


def test_a_wait_teaches_the_rate_only_for_the_samples_that_were_missing():
    f = ValleyForecast()
    f.decide((6, 8))  # 2 missing
    f.observe_wait(1.0)
    assert f.expected(0, 8) == pytest.approx(4.0)  # 0.5 s per sample
    f.decide((8, 8))  # none missing: a wait teaches nothing about the rate
    f.observe_wait(0.01)
    assert f.expected(0, 8) == pytest.approx(4.0)


# --------------------------------------------------------------------------- the handoff


def _handoff(swap: str, backlog, forecast: ValleyForecast | None = None, prepare: bool = True):
    calls = Calls()
    h = Handoff("j", client=Agent(calls), ranks=Ranks(calls), swap=swap, prepare=prepare, backlog=backlog)
    if forecast is not None:
        h.planner = forecast
        h._way_back.forecast = forecast
    reports: list = []
    h.report = reports.append
    return h, calls, reports


def test_a_release_whose_next_batch_is_queued_is_skipped():
    h, calls, reports = _handoff("park", backlog=lambda: (8, 8))
    out = h.release("weight_sync_end")
    assert out.action == "skip" and out.detail == "next batch queued (8/8 samples)"
    assert calls == [] and h.held, "no park, no agent call: the trainer keeps its GPU"
    assert h.acquire("pre_train_step") is None and calls == []
    assert [r.action for r in reports] == ["skip"]


def test_a_prepared_acquire_waits_for_nothing_with_a_park_swap():
    """The way back ran in the background (agent acquire, every rank's unpark): the trainer's acquire
    makes no call at all."""
    h, calls, reports = _handoff("park", backlog=lambda: (0, 20), forecast=learned(round_trip_s=0.01))
    h.planner.thaw_s = 100.0  # lead 120 s: the way back is due at once
    h.planner.lead_s = 0.0
    h.release("weight_sync_end")
    eventually(lambda: "agree:unpark" in calls, what="the way back's unpark")
    before = list(calls)
    out = h.acquire("pre_train_step")
    assert calls == before, "the trainer's acquire called neither the agent nor the ranks"
    assert before[-4:] == ["agent.acquire", "agree:acquire", "unpark", "agree:unpark"]
    assert out.action == "acquire" and out.detail == "prepared ahead of need" and out.early_s >= 0
    assert [(r.action, r.point) for r in reports][-2:] == [("acquire", "prepare"), ("acquire", "pre_train_step")]


def test_a_prepared_acquire_waits_only_for_the_agent_with_a_checkpoint_swap():
    h, calls, reports = _handoff("checkpoint", backlog=lambda: (0, 20), forecast=learned(lead_s=100.0))
    h.release("weight_sync_end")
    eventually(lambda: "agent.prepare" in calls, what="the way back's prepare")
    h.acquire("pre_train_step")
    assert calls[-3:] == ["agent.prepare", "agent.acquire", "agree:acquire"], "the acquire only asked the agent"


def test_a_way_back_not_yet_due_is_cancelled_by_the_acquire():
    h, calls, reports = _handoff("park", backlog=lambda: (0, 20000), forecast=learned())
    h.release("weight_sync_end")
    h.acquire("pre_train_step")
    assert calls.count("agent.acquire") == 1 and "agent.prepare" not in calls
    assert calls[-4:] == ["agent.acquire", "agree:acquire", "unpark", "agree:unpark"], "the trainer's own acquire did it"


def test_the_way_back_fires_while_the_next_sample_is_under_way():
    """One sample missing, 0.2 s per sample, lead 0.05 s: the backlog never moves, yet the way back starts —
    the standing still is the sample's progress (read from the backlog alone it would wait forever)."""
    h, calls, reports = _handoff("park", backlog=lambda: (19, 20),
                                 forecast=learned(per_sample_s=0.2, round_trip_s=0.01, lead_s=0.05))
    assert h.release("weight_sync_end").action == "release"
    eventually(lambda: "agree:unpark" in calls, what="the way back's acquire and unpark")
    out = h.acquire("pre_train_step")
    assert out.detail == "prepared ahead of need"
