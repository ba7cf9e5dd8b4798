"""The dispatcher's rules: start once, gating vs observing errors, off-loop calls, fire-once."""

from __future__ import annotations

import asyncio
import threading
import logging

import pytest

from timeslice_verl import hookimpl
from timeslice_verl.config.schema import TimesliceSettings
from timeslice_verl.hooks.events import RolloutEvent, TrainStepEvent, WeightSyncEvent
from timeslice_verl.hooks.lifecycle import Lifecycle
from timeslice_verl.hooks.manager import TimesliceManager


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
    lc.post_rollout(lc.event(RolloutEvent, samples=8))
    lc.pre_train_step(lc.event(TrainStepEvent))
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
        lc.post_rollout(lc.event(RolloutEvent, samples=1))
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
        lc.pre_train_step(lc.event(TrainStepEvent))
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
        await lc.fire(lc.pre_train_step, lc.event(TrainStepEvent))
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
        lc.weight_sync_begin(lc.event(WeightSyncEvent))
        lc.post_rollout(lc.event(RolloutEvent, samples=2))
    assert "post_rollout [p0] -> []" in caplog.text and "timeslice_start [p0]" in caplog.text


def test_the_facade_fires_every_hook_by_a_method_of_its_name_with_the_event_type_it_takes():
    """tox 4's manager does the same: ``lifecycle.post_rollout(event)`` is checked when the module loads and by a type
    checker, where ``call("post_rolout", …)`` failed at run time; start, stop and exceptions have their own calls."""
    import typing

    from timeslice_verl.hooks import events
    from timeslice_verl.hooks.spec import hook_names

    by_own_call = {"timeslice_start": Lifecycle.start, "timeslice_stop": Lifecycle.stop,
                   "trainer_exception": Lifecycle.report_exception}
    for name in hook_names():
        method = by_own_call.get(name) or getattr(Lifecycle, name)
        if name in by_own_call:
            continue
        hints = typing.get_type_hints(method, vars(events))
        assert issubclass(hints["event"], events.Event), name


def test_a_hook_fired_after_the_stop_reaches_no_plugin():
    from timeslice_verl.hooks.events import HandoffEvent

    rec = Recorder()
    lc = build(rec)
    lc.post_rollout(lc.event(RolloutEvent, samples=1))
    lc.stop()
    lc.handoff(lc.event(HandoffEvent, action="release"))
    assert rec.calls[-1][0] == "stop"
