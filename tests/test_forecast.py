"""The pure valley forecast: arrivals read off the backlog, break-even, when the way back starts, what it learns —
table by table — and the whole of it against seeded rollouts shaped like verl's (a virtual clock: no sleeping)."""

from __future__ import annotations

import math

import pytest

from timeslice_verl.demo.arrivals import PROFILES, RolloutSim, scaled
from timeslice_verl.handoff.forecast import (
    COLD_TRIP_S,
    MIN_ARRIVALS,
    MIN_TAIL,
    ArrivalRate,
    ValleyForecast,
    ValleyPlan,
    erlang_cdf,
    erlang_quantile,
    remaining,
)
from timeslice_verl.testing.valleys import replay


# --------------------------------------------------------------------------- arrivals from backlog reads


@pytest.mark.parametrize(
    ("reads", "arrivals", "rate"),
    [
        ([(0, 0), (1, 2), (2, 4)], [0, 2, 2], 2.0),  # 2 a second
        ([(0, 14), (1, 3)], [0, 5], 5.0),  # fewer queued: a batch of 16 was taken meanwhile, and 5 came
        ([(0, 14), (1, 3), (2, 5)], [0, 5, 2], 3.5),
        ([(0, 20), (1, 24), (2, 26)], [0, 4, 2], None),  # a whole batch waited: production may be held, not counted
        ([(0, 0), (1, 0), (2, 0), (3, 3)], [0, 0, 0, 3], 1.0),  # quiet reads count as time
    ],
)
def test_arrivals_are_read_off_the_backlog(reads, arrivals, rate):
    a = ArrivalRate()
    assert [a.observe(t, q, 16) for t, q in reads] == arrivals
    assert a.rate() == (pytest.approx(rate) if rate is not None else None)


def test_the_rate_follows_the_last_window_of_samples():
    a = ArrivalRate(window=8)
    t = 0.0
    for _ in range(20):  # 1 a second
        t += 1.0
        a.observe(t, int(t) % 16, 16)
    for _ in range(20):  # then 4 a second (shorter responses): the old spans leave the window
        t += 0.25
        a.observe(t, (a._last[1] + 1) % 16, 16)
    assert a.rate() == pytest.approx(4.0, rel=0.2)


# --------------------------------------------------------------------------- the Erlang helpers


@pytest.mark.parametrize(("k", "rate"), [(1, 1.0), (3, 2.0), (16, 0.5)])
def test_erlang_quantile_inverts_the_cdf(k, rate):
    for p in (0.1, 0.5, 0.9):
        assert erlang_cdf(erlang_quantile(p, k, rate), k, rate) == pytest.approx(p, abs=1e-6)


@pytest.mark.parametrize(("missing", "rate", "age", "expected"), [
    (4, 2.0, 0.0, 2.0), (4, 2.0, 0.25, 1.75), (1, 1.0, 5.0, 0.05), (1, 1.0, 0.5, 0.5)])
def test_the_expected_wait_counts_the_next_samples_progress(missing, rate, age, expected):
    assert remaining(missing, rate, age) == pytest.approx(expected)


# --------------------------------------------------------------------------- break-even


def _learned(rate: float = 2.0, trip: float | None = 1.0, margin: float = 1.5) -> ValleyForecast:
    f = ValleyForecast(margin=margin)
    for i in range(20):
        f.observe_backlog(i / rate, (i % 16, 16))
    if trip is not None:
        f.observe_round_trip(trip)
    return f


@pytest.mark.parametrize(
    ("forecast", "backlog", "release", "reason"),
    [
        (ValleyForecast(), None, True, "no backlog signal"),
        (ValleyForecast(), (8, 8), False, "next batch queued (8/8 samples)"),
        (ValleyForecast(), (0, 8), False, "no valley forecast yet and the round trip (unknown) is not below 1 s: "
                                          "learning this valley"),
        (_learned(trip=None, rate=0.1), (0, 8), True, "valley 80.00 s expected; no round trip known yet"),
        (_learned(), (14, 16), False, "valley 1.00 s expected (10 %: 0.27 s; 14/16 samples at 2.00/s) < 1.5 × round "
                                      "trip 1.00 s"),
        (_learned(), (10, 16), True, "valley 3.00 s expected (10 %: 1.58 s) ≥ 1.5 × round trip 1.00 s"),
        (_learned(), (0, 16), True, "valley 8.00 s expected (10 %: 5.57 s) ≥ 1.5 × round trip 1.00 s"),
        (_learned(margin=0.0), (16, 16), True, "every valley is lent (break_even_margin=0)"),
        (_learned(trip=12.0), (0, 16), False, "valley 8.00 s expected (10 %: 5.57 s; 0/16 samples at 2.00/s) < 1.5 × "
                                              "round trip 12.00 s"),
    ],
)
def test_decide(forecast, backlog, release, reason):
    d = forecast.decide(backlog)
    assert (d.release, d.reason) == (release, reason)


@pytest.mark.parametrize(("estimate", "lent"), [(0.3, True), (COLD_TRIP_S, True), (12.0, False), (None, False)])
def test_a_cold_start_lends_only_a_handoff_estimated_cheap(estimate, lent):
    """Before any rate is known (the first valley), the round trip's estimate (bytes over bandwidth plus the
    tenant's yield) decides: a checkpoint of many GiB is not gambled on a valley of unknown length."""
    f = ValleyForecast()
    f.round_trip_estimate = estimate
    assert f.decide((0, 16)).release is lent


# --------------------------------------------------------------------------- when the way back starts


TAIL_1 = (0.1, 0.2, 0.3, 0.4, 0.5, 1.0, 2.0, 4.0)  # what the last sample took, in mean gaps


@pytest.mark.parametrize(
    ("plan", "missing", "rate", "age", "due"),
    [
        (ValleyPlan(rate=2.0, way_back_s=0.2), 0, None, 0.0, 0.0),  # complete: now
        # no tails yet: the level's (20 %) quantile of the time to 4 arrivals at 2/s (an Erlang's), less the way back
        (ValleyPlan(rate=2.0, way_back_s=0.2), 4, None, 0.0, erlang_quantile(0.2, 4, 2.0) - 0.2),
        (ValleyPlan(rate=2.0, way_back_s=0.2), 4, 4.0, 0.0, erlang_quantile(0.2, 4, 4.0) - 0.2),  # the given rate wins
        # the next sample 0.25 s along at 2/s: half of it done
        (ValleyPlan(rate=2.0, way_back_s=0.2), 4, None, 0.25, erlang_quantile(0.2, 4, 2.0) - 0.25 - 0.2),
        # two missing after a train step with no sample (4 s at 0.2/s): the next may be near, not the one after it
        (ValleyPlan(rate=0.2, way_back_s=0.0), 2, None, 4.0, erlang_quantile(0.2, 1, 0.2)),
        (ValleyPlan(rate=0.2, way_back_s=0.0), 1, None, 4.0, 0.0),  # one missing and overdue: now
        (ValleyPlan(rate=None, way_back_s=0.2), 4, None, 0.0, None),  # nothing to go on
        (ValleyPlan(rate=2.0, way_back_s=0.2, lead_s=1.0), 4, None, 0.0, 1.0),  # a fixed lead
        # one missing, a tail measured: the level (20 %) quantile of the waits that outlast the age, less w
        (ValleyPlan(rate=1.0, way_back_s=0.1, level=0.2, tails=((), TAIL_1)), 1, None, 0.0, 0.14),
        # the longer the last sample takes, the longer it is likely to take still (a heavy tail): not sooner
        (ValleyPlan(rate=1.0, way_back_s=0.1, level=0.2, tails=((), TAIL_1)), 1, None, 0.45, 0.25),
        (ValleyPlan(rate=1.0, way_back_s=0.1, level=0.2, tails=((), TAIL_1)), 1, None, 0.8, 0.5),
        (ValleyPlan(rate=1.0, way_back_s=0.1, level=0.2, tails=((), TAIL_1)), 1, None, 9.0, 0.0),  # overdue
        (ValleyPlan(rate=1.0, way_back_s=0.5, valleys=(4.0, 5.0, 6.0)), None, None, 0.0, 3.9),  # no backlog
    ],
)
def test_due_in(plan, missing, rate, age, due):
    got = plan.due_in(missing, rate, age_s=age)
    assert got == (pytest.approx(due, abs=1e-9) if due is not None else None)


def test_the_erlang_quantile_is_below_the_expectation_at_a_level_under_one_half():
    """The newsvendor's level (1 / (1 + late_cost)) of the wait, not its mean: late in a fifth of the valleys, not half."""
    assert erlang_quantile(0.2, 4, 2.0) < 4 / 2.0
    assert ValleyPlan(rate=2.0, way_back_s=0.2).due_in(4) < ValleyPlan(rate=2.0, way_back_s=0.2, lead_s=0.2).due_in(4)


def _arrivals(times: list[float], required: int = 32) -> ArrivalRate:
    a = ArrivalRate()
    for i, t in enumerate(times):
        a.observe(t, i, required)
    return a


@pytest.mark.parametrize(
    ("plan_rate", "times", "pace"),
    [
        (5.0, [0.0, 10.0, 10.1], 5.0),  # two samples after a pause: too few to trust, the release's rate
        (None, [0.0, 10.0, 10.1], None),  # and none known: nothing (the valleys' lengths decide)
        (5.0, [0.1 * i for i in range(MIN_ARRIVALS + 1)], pytest.approx(10.0)),  # enough of its own: its own
    ],
)
def test_the_way_back_trusts_its_own_rate_after_enough_samples(plan_rate, times, pace):
    assert ValleyPlan(rate=plan_rate, way_back_s=0.1).pace(_arrivals(times)) == pace


def test_a_valley_teaches_what_each_count_of_missing_samples_still_took():
    f = ValleyForecast()
    for i in range(10):
        f.observe_backlog(float(i), (i, 16))  # 1 a second
    reads = [(10.0, (10, 16)), (11.0, (12, 16)), (12.0, (15, 16)), (13.0, (15, 16))]
    f.observe_valley(4.0, reads, end=14.0)
    # 12 queued at 11 s (4, 5 missing reached then: 3 s left), 15 at 12 s (1, 2, 3 missing: 2 s left)
    assert {k: list(v) for k, v in f.tails.items()} == {4: [3.0], 5: [3.0], 1: [2.0], 2: [2.0], 3: [2.0]}
    assert list(f.valleys) == [4.0]


def test_the_tail_takes_over_once_it_has_enough_valleys():
    f = ValleyForecast()
    for i in range(40):
        f.observe_backlog(i * 0.5, (i % 16, 16))
    for _ in range(MIN_TAIL):
        f.observe_valley(5.0, [(0.0, (14, 16)), (1.0, (15, 16))], end=1.0 + 1.5)  # the last sample: 1.5 s, always
    f.observe_way_back(0.2)
    plan = f.plan()
    assert plan.tails[1] and plan.due_in(1, age_s=0.0) == pytest.approx(1.5 - 0.2), "an exact tail: the exact lead"


# --------------------------------------------------------------------------- against verl-shaped rollouts


def test_the_rollout_simulation_is_seeded_and_keeps_the_staleness_bound():
    p = scaled(PROFILES["fleet"], required=32, valley_s=8.0)
    runs = []
    for _ in range(2):
        sim = RolloutSim(p, 32, seed=7)
        sim.advance(30.0)
        runs.append(list(sim.arrivals))
    assert runs[0] == runs[1] and len(runs[0]) > 32
    assert sim.queued + len(sim._slots) <= sim.cap and sim.queued <= sim.cap


@pytest.mark.parametrize(
    ("profile", "way_back_s", "late_at_most", "lost_at_most"),
    [
        ("even", 0.14, 0.3, 0.03),
        ("even", 0.56, 0.3, 0.03),
        ("fleet", 0.14, 0.35, 0.08),
        ("fleet", 0.56, 0.35, 0.13),
        ("longtail", 0.14, 0.35, 0.08),
        ("longtail", 0.56, 0.35, 0.13),
    ],
)
def test_the_forecast_holds_under_rollouts_shaped_like_verls(profile, way_back_s, late_at_most, lost_at_most):
    """40 valleys of each rollout shape (seeded), the way back of a resident swap (0.14 s) and of a park of 17 GiB
    (0.56 s): most way backs are ahead of the batch (the first valleys, before the run's own record of what the
    last samples take, are timed by the rate alone), the GPU time given up early stays a small part of the
    valleys, and no lent valley is shorter than its round trip."""
    r = replay(profile, way_back_s=way_back_s, seed=3)
    late = len(r.late) / r.lent
    lost = sum(r.early) / sum(r.valleys)
    assert r.lent >= 35 and r.below_break_even == 0
    assert late <= late_at_most, (late, r.quantile(r.early, 0.5))
    assert lost <= lost_at_most, (lost, late)
    assert max(r.late) <= way_back_s + 1e-9, "a late way back costs at most the way back itself"


@pytest.mark.parametrize("profile", ["fleet", "longtail"])
def test_a_short_runs_way_back_is_late_in_about_the_levels_share_of_valleys(profile):
    """Nine valleys of 4 s (the H200 harvest benchmark's run), 40 seeds: before the run has its own tails the way back
    is timed by the Erlang quantile at the newsvendor's level (a fifth), not by the expectation (late in half)."""
    lent = late = 0
    for seed in range(40):
        r = replay(profile, steps=9, required=32, train_s=1.0, valley_s=4.0, way_back_s=0.15, seed=seed)
        lent, late = lent + r.lent, late + len(r.late)
    assert lent >= 300 and late / lent <= 0.3, late / lent


def test_a_checkpoint_swap_never_gambles_a_valley_it_cannot_time():
    """Round trips of 14 s (16 GiB by the driver) against valleys of about 8: nothing is lent, the first included."""
    r = replay("fleet", way_back_s=7.0, round_trip_s=14.0, seed=1)
    assert r.lent == 0 and r.skipped > 0 and r.below_break_even == 0
    long = replay("fleet", way_back_s=7.0, round_trip_s=14.0, valley_s=40.0, seed=1)
    assert long.lent > 0 and long.below_break_even == 0
    assert all(math.isfinite(v) for v in long.valleys)


# --------------------------------------------------------------------------- the Erlang quantile at any size


@pytest.mark.parametrize("k, rate, p, expected, within", [
    (1024, 10.0, 0.1, 98.3, 0.01),     # saturated at 74.5 s before (exp(-lx) underflowed)
    (4096, 10.0, 0.1, 401.4, 0.01),
    (10**18, 10.0, 0.1, 1e17, 0.01),   # a backlog read of (0, 10**18): bounded work, a finite answer
    (200, 5.0, 0.5, 39.93, 0.01),      # the last exact k and the first approximated one agree
    (201, 5.0, 0.5, 40.13, 0.01),
    (1, 2.0, 0.5, math.log(2) / 2, 1e-6),
])
def test_the_erlang_quantile_is_right_at_any_size(k, rate, p, expected, within):
    from timeslice_verl.handoff.forecast import erlang_quantile

    assert erlang_quantile(p, k, rate) == pytest.approx(expected, rel=within)


@pytest.mark.parametrize("x, k, rate", [(1e300, 5, 1e300), (float("nan"), 5, 1.0), (1.0, 5, float("nan")),
                                        (1e-300, 10**18, 1e-300), (745.2, 3, 1.0), (1e6, 150, 1.0)])
def test_the_erlang_cdf_is_a_probability_for_any_input(x, k, rate):
    from timeslice_verl.handoff.forecast import erlang_cdf

    assert 0.0 <= erlang_cdf(x, k, rate) <= 1.0


@pytest.mark.parametrize("ways, planned", [
    ([0.2], 0.2),
    ([0.05] * 8 + [0.4] * 4, 0.4),  # a pause that is slow one valley in three: planned for
    ([0.05] * 10 + [0.4], 0.05),  # one slow pause in eleven: not
    ([0.4] + [0.05] * 12, 0.05),  # only the last twelve count
])
def test_the_way_back_planned_for_is_the_upper_quartile_of_the_recent_ones(ways, planned):
    forecast = ValleyForecast()
    for seconds in ways:
        forecast.observe_way_back(seconds)
    assert forecast.way_back_s == planned
