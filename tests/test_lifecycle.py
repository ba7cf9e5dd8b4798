"""The dispatcher's rules: start once, gating vs observing errors, off-loop calls, fire-once."""

from __future__ import annotations

import asyncio
import threading
import logging

import pytest

from timeslice_verl import hookimpl
from timeslice_verl.config import TimesliceSettings
from timeslice_verl.events import RolloutEvent, TrainStepEvent, WeightSyncEvent
from timeslice_verl.lifecycle import Lifecycle
from timeslice_verl.manager import TimesliceManager


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def timeslice_start(self, event, lifecycle):
        self.calls.append(("start", event.adapter))
        self.lifecycle = lifecycle

    @hookimpl
    def post_rollout(self, event):
        self.calls.append(("post_rollout", event.samples))

    @hookimpl
    def pre_train_step(self, event):
        self.calls.append(("pre_train_step", event.step))

    @hookimpl
    def trainer_exception(self, event):
        self.calls.append(("exception", event.point, event.error_type))

    @hookimpl
    def timeslice_stop(self, event):
        self.calls.append(("stop", event.reason))


class FakeTrainer:
    global_steps = 3
    current_param_version = 2


def build(*plugins, **settings_kw) -> Lifecycle:
    manager = TimesliceManager()
    for i, p in enumerate(plugins):
        manager.register(p, f"p{i}")
    manager.check()
    return Lifecycle(TimesliceSettings(job="job-a", **settings_kw), manager, trainer=FakeTrainer(), adapter="stock")


def test_start_fires_once_before_the_first_event_and_events_carry_progress():
    rec = Recorder()
    lc = build(rec)
    lc.call("post_rollout", lc.event(RolloutEvent, samples=8))
    lc.call("pre_train_step", lc.event(TrainStepEvent))
    lc.stop()
    lc.stop()
    assert rec.calls == [("start", "stock"), ("post_rollout", 8), ("pre_train_step", 3), ("stop", "finished")]
    event = lc.event(TrainStepEvent)
    assert (event.job, event.step, event.param_version) == ("job-a", 3, 2)
    assert rec.lifecycle is lc


def test_observing_hook_error_is_reported_and_others_still_run(caplog):
    class Broken:
        @hookimpl
        def post_rollout(self, event):
            raise RuntimeError("observer bug")

    rec = Recorder()
    lc = build(rec, Broken())  # Broken registered last: called first
    with caplog.at_level(logging.ERROR, logger="timeslice"):
        lc.call("post_rollout", lc.event(RolloutEvent, samples=1))
    assert ("post_rollout", 1) in rec.calls
    assert "plugin p1 raised in post_rollout" in caplog.text


def test_gating_hook_error_propagates_and_stops_the_chain():
    class Denied:
        @hookimpl
        def pre_train_step(self, event):
            raise TimeoutError("no GPU for you")

    rec = Recorder()
    lc = build(rec, Denied())
    with pytest.raises(TimeoutError, match="no GPU"):
        lc.call("pre_train_step", lc.event(TrainStepEvent))
    assert not [c for c in rec.calls if c[0] == "pre_train_step"]


def test_a_blocking_hook_does_not_stall_the_event_loop():
    """The hook blocks until the event loop has run: it can only return if fire() moved it off the loop."""
    loop_ran = threading.Event()

    class Blocking:
        @hookimpl
        def pre_train_step(self, event):
            assert loop_ran.wait(120), "the event loop never ran while the hook blocked"

    lc = build(Blocking())

    async def scenario():
        async def ticker():
            for _ in range(5):
                await asyncio.sleep(0)
            loop_ran.set()

        task = asyncio.create_task(ticker())
        await lc.fire("pre_train_step", lc.event(TrainStepEvent))
        await task

    asyncio.run(scenario())
    assert loop_ran.is_set()


def test_exception_fires_once_per_exception_object():
    rec = Recorder()
    lc = build(rec)
    err = ValueError("boom")
    assert lc.report_exception("update_weights", err) is True
    assert lc.report_exception("fit", err) is False
    assert lc.report_exception("fit", ValueError("another")) is True
    assert [c for c in rec.calls if c[0] == "exception"] == [
        ("exception", "update_weights", "ValueError"),
        ("exception", "fit", "ValueError"),
    ]


def test_trace_logs_every_call(caplog):
    rec = Recorder()
    lc = build(rec)
    lc.settings.plugins.trace = True
    with caplog.at_level(logging.INFO, logger="timeslice.trace"):
        lc.call("weight_sync_begin", lc.event(WeightSyncEvent))
        lc.call("post_rollout", lc.event(RolloutEvent, samples=2))
    assert "post_rollout [p0] -> []" in caplog.text and "timeslice_start [p0]" in caplog.text


def test_notify_refuses_gating_hooks():
    lc = build(Recorder())
    with pytest.raises(ValueError, match="gating"):
        lc.notify("pre_train_step", lc.event(TrainStepEvent))


def test_a_background_report_never_waits_for_the_hook_call_that_waits_for_it():
    """The way back's thread reports its acquire while the trainer's thread is inside ``pre_train_step``,
    whose acquire joins that very thread: the report must not wait for the dispatcher (it did, and a real
    run on an H200 hung there); it reaches the observers when the hook call returns, with its own time."""
    from timeslice_verl.events import HandoffEvent

    seen: list[tuple[str, float]] = []

    class Observer:
        @hookimpl
        def handoff(self, event):
            seen.append((event.point, event.time))

    class JoinsABackgroundReport:
        @hookimpl
        def pre_train_step(self, event):
            t = threading.Thread(target=lambda: lc.notify("handoff", lc.event(HandoffEvent, action="acquire", point="prepare")))
            t.start()
            t.join(60)
            assert not t.is_alive(), "the background report waited for this hook call"
            assert seen == [], "delivered only once the call that holds the dispatcher returns"

    lc = build(Observer(), JoinsABackgroundReport())
    before = lc.event(TrainStepEvent).time
    lc.call("pre_train_step", lc.event(TrainStepEvent))
    assert [p for p, _ in seen] == ["prepare"] and seen[0][1] >= before
    lc.notify("handoff", lc.event(HandoffEvent, action="release", point="weight_sync_end"))
    assert [p for p, _ in seen] == ["prepare", "weight_sync_end"], "no call under way: delivered at once"
