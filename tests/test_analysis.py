"""What the timeline summary says of the valleys and the way back, from hand-written records."""

from __future__ import annotations

import pytest

from timeslice_verl.analysis import forecast, valleys


def handoff(action: str, point: str, t: float, waited: float = 0.0, moves: float = 0.0, **extra) -> dict:
    trans = [{"action": "thaw", "start": t - moves, "end": t, "ok": True}] if moves else []
    return {"hook": "handoff", "action": action, "point": point, "time": t, "waited_s": waited, "transitions": trans,
            "ok": True, **extra}


START = [handoff("acquire", "init_workers_begin", 1.0), handoff("release", "init_workers_end", 2.0)]


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([], {"lent": 0, "below_break_even": 0, "cut_by_end": 0, "valley_s_p50": None, "round_trip_s_p50": None}),
        # a 10 s valley (release at 2, acquire asked at 12) that cost 0.1 + 0.5 + 0.2 s
        ([*START, handoff("acquire", "pre_train_step", 12.7, waited=0.7, moves=0.5, park_s=0.2)],
         {"lent": 1, "below_break_even": 0, "cut_by_end": 0, "valley_s_p50": 10.0, "round_trip_s_p50": 0.7}),
        # asked again 0.05 s after the release: shorter than its own round trip
        ([*START, handoff("acquire", "pre_train_step", 2.6, waited=0.55, moves=0.5)],
         {"lent": 1, "below_break_even": 1, "cut_by_end": 0, "valley_s_p50": 0.05, "round_trip_s_p50": 0.5}),
        # the run ended 0.3 s after the last release: the final acquire brings the parked ranks back
        ([*START, handoff("acquire", "timeslice_stop", 2.7, waited=0.4, moves=0.1, park_s=0.3)],
         {"lent": 0, "below_break_even": 0, "cut_by_end": 1, "valley_s_p50": None, "round_trip_s_p50": None}),
        # a skipped valley is not lent
        ([handoff("acquire", "init_workers_begin", 1.0), handoff("skip", "weight_sync_end", 2.0)],
         {"lent": 0, "below_break_even": 0, "cut_by_end": 0, "valley_s_p50": None, "round_trip_s_p50": None}),
    ],
)
def test_valleys(records, expected):
    assert valleys(records) == expected


def test_forecast_reports_the_way_backs_early_and_late():
    records = [
        handoff("acquire", "prepare", 5.0, waited=0.4),  # the way back, in the background: no trainer wait
        handoff("acquire", "pre_train_step", 6.0, waited=0.0, early_s=1.0),
        handoff("acquire", "pre_train_step", 9.0, waited=0.3),  # a late one: the trainer waited
    ]
    f = forecast(records)
    assert f["prepared"] == 1
    assert f["early_ms"] == {"n": 1, "p50": 1000.0, "p90": 1000.0, "max": 1000.0, "total": 1000.0}
    assert f["late_ms"] == {"n": 1, "p50": 300.0, "p90": 300.0, "max": 300.0, "total": 300.0}


def test_park_and_unpark_are_swapping_not_idle_time_with_no_owner():
    """A release call of 0.5 s (0.4 s of it parking) and an acquire that unparked for 0.4 s: the handoff's, both."""
    from timeslice_verl.analysis import summary

    records = [
        {"hook": "timeslice_start", "time": 0.0, "job": "j"},
        handoff("acquire", "init_workers_begin", 0.0),
        handoff("release", "weight_sync_end", 1.5, waited=0.5, park_s=0.4, parked_bytes=10),  # began at 1.0
        handoff("acquire", "pre_train_step", 5.0, waited=0.5, park_s=0.4, parked_bytes=10),  # unparked 4.6-5.0
        {"hook": "timeslice_stop", "time": 6.0, "job": "j"},
    ]
    s = summary(records)
    assert s["seconds"]["swapping"] == pytest.approx(0.5 + 0.4)
    assert s["seconds"]["trainer"] == pytest.approx(1.0 + 1.0)
    assert s["seconds"]["idle"] == pytest.approx(6.0 - 2.0 - 0.9)


def test_a_resident_release_call_is_the_handoff_not_idle_time():
    """A resident release moves nothing, but its call (freeing caches, the agent's answer) is the handoff under way."""
    from timeslice_verl.analysis import summary

    records = [
        {"hook": "timeslice_start", "time": 0.0, "job": "j"},
        handoff("acquire", "init_workers_begin", 0.0),
        handoff("release", "weight_sync_end", 1.1, waited=0.1, swap="resident"),  # held until 1.0, the call till 1.1
        handoff("acquire", "pre_train_step", 3.0),
        {"hook": "timeslice_stop", "time": 4.0, "job": "j"},
    ]
    s = summary(records)
    assert s["seconds"]["swapping"] == pytest.approx(0.1)
    assert s["seconds"]["idle"] == pytest.approx(4.0 - 2.0 - 0.1)
