"""The demo's stand-ins for verl's rollout queue: a fixed schedule, a backlog the handoff can read."""

from __future__ import annotations

import threading

import pytest

from agent_support import eventually
from timeslice_verl.demo.trainer import BURST_SPEEDUP, DemoRollout, schedule


def test_the_schedule_is_fixed_by_the_seed_and_bursts_come_faster():
    a = schedule(8, 10.0, burst_every=4, seed=3)
    assert a == schedule(8, 10.0, burst_every=4, seed=3) and a != schedule(8, 10.0, burst_every=4, seed=4)
    plain = schedule(8, 10.0, seed=3)
    for i, (x, y) in enumerate(zip(a, plain)):
        assert x == pytest.approx(y / BURST_SPEEDUP if (i + 1) % 4 == 0 else y)
    assert all(8.0 <= y <= 12.0 for y in plain)


def test_take_waits_for_a_whole_batch_and_the_backlog_counts_what_is_queued():
    rollout = DemoRollout([0.05, 0.05, 0.05], required=4).start()
    try:
        rollout.take()
        queued, required = rollout.backlog()
        assert required == 4 and 0 <= queued <= 8
        eventually(lambda: rollout.backlog()[0] == 8, what="the two remaining batches queued")
        rollout.take()
        assert rollout.backlog() == (4, 4)  # the next batch is already there: a release would be skipped
    finally:
        rollout.stop()


def test_a_stopped_rollout_ends_a_waiting_take():
    rollout = DemoRollout([3600.0], required=4).start()
    errors: list[BaseException] = []

    def take() -> None:
        try:
            rollout.take()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=take)
    t.start()
    rollout.stop()
    t.join(30)
    assert not t.is_alive() and "stopped" in str(errors[0])


def test_a_profiled_rollout_delivers_batches_and_a_sync_before_its_start_changes_nothing():
    """The realistic arrivals in the wall clock: batches come, the backlog counts them, a weight sync holds the
    requests in flight back; a sync before the rollouter starts (fully_async_main's pre-fit sync) is harmless."""
    rollout = DemoRollout.profiled("fleet", required=8, batch_s=0.05, seed=1)
    rollout.sync()
    rollout.start()
    try:
        for _ in range(3):
            rollout.take()
            rollout.sync()
        queued, required = rollout.backlog()
        assert required == 8 and 0 <= queued <= rollout.sim.cap
        assert rollout.sim.step == 3
    finally:
        rollout.stop()


def test_an_unknown_profile_is_refused_naming_the_ones_there_are():
    with pytest.raises(ValueError, match="not one of: even, fleet, longtail"):
        DemoRollout.profiled("bursty", required=8, batch_s=1.0)
