"""The in-flight limit: the policy (:func:`next_limit`, :func:`shed_to`) table-tested on synthetic vLLM
``/metrics`` samples, and the feeder's loop (:class:`Follower`) sample by sample. Pure: no server, no clock."""

from __future__ import annotations

import math

import pytest

from timeslice_verl.batch.concurrency import (
    Climb,
    Follower,
    Policy,
    Sample,
    Window,
    next_limit,
    parse_metrics,
    shed_to,
)


def _metrics(running: float, waiting: float, kv: float | None = None) -> str:
    text = (f"# HELP vllm:num_requests_running x\nvllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n"
            f"vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}\n"
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 9.0\n')
    return text + (f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n' if kv is not None else "")


@pytest.mark.parametrize("text, sample", [
    (_metrics(12, 3, 0.5), Sample(12, 3, 0.5)),
    (_metrics(12, 3), Sample(12, 3, None)),
    (_metrics(5, 1) + _metrics(7, 2).replace('engine="0"', 'engine="1"'), Sample(12, 3, None)),  # engines summed
    ("vllm:gpu_cache_usage_perc 0.25\nvllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", Sample(1, 0, 0.25)),
    (_metrics(2, 0) + 'vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0\n', Sample(2, 0, None, 1234.0)),
    ("# nothing of vLLM here\nprocess_cpu_seconds_total 3\n", None),
    ("vllm:num_requests_running{} NaN\n", None),
    ("vllm:num_requests_running garbage\n", None),
])
def test_vllms_metrics_read_as_a_sample(text, sample):
    assert parse_metrics(text) == sample


P = Policy(start=32, ceiling=1024, min_queue=4, queue_fraction=0.1)


@pytest.mark.parametrize("limit, inflight, sample, previous, expected, why", [
    (32, 32, Sample(32, 0), None, 48, "no queue inside vLLM and our limit used: grow by half"),
    (32, 10, Sample(10, 0), None, 32, "our limit is not what holds vLLM back: hold"),
    (512, 512, Sample(256, 256), Sample(256, 250), 282, "vLLM full at 256: what it runs plus the wanted queue (26)"),
    (512, 512, Sample(256, 256), None, 512, "a long queue at the first sample since the gate opened: wait for a second"),
    (384, 384, Sample(44, 300), Sample(10, 320), 384, "a queue behind a running count still growing: admission, hold"),
    (384, 384, Sample(44, 300), Sample(380, 0), 384, "a wave of answers ended and its lines were sent again: hold"),
    (384, 384, Sample(200, 100, 0.95), None, 220, "a queue and the KV cache nearly full: full at once"),
    (300, 300, Sample(256, 30), Sample(256, 30), 300, "a queue near the wanted one: hold"),
    (300, 300, Sample(200, 10, 0.99), None, 300, "KV cache full with requests waiting: hold"),
    (1000, 1000, Sample(1000, 0), None, 1024, "never past the ceiling"),
    (2, 2, Sample(0, 40), Sample(0, 40), 4, "at least the wanted queue"),
    (77, 77, None, None, 77, "no metrics: as it is"),
])
def test_the_in_flight_limit_follows_the_tenant(limit, inflight, sample, previous, expected, why):
    assert next_limit(limit, inflight, sample, P, previous=previous)[0] == expected, why


@pytest.mark.parametrize("limit, rate, climb, now, expected, why", [
    (48, 900.0, Climb(600.0, 32), 5.0, (96, Climb(900.0, 48, looked_down=True)),
     "the growth paid by half: far from the knee, double (below it measured on the way up)"),
    (48, 700.0, Climb(600.0, 32), 5.0, (72, Climb(700.0, 48, looked_down=True)), "the growth paid a sixth: grow on by half"),
    (72, 800.0, Climb(900.0, 48), 6.0, (48, Climb(900.0, 48, 36.0, 1, looked_down=True)),
     "a probe up cost tokens: back to the limit it started from, hold 30 s (one probe is weak evidence)"),
    (60, 800.0, Climb(900.0, 48, failed=1), 6.0, (32, Climb(900.0, 48, failed=1, down=True, looked_down=True)),
     "the second failed probe in a row: look once below the limit it started from (past the knee itself?)"),
    (32, 1000.0, Climb(900.0, 48, down=True, looked_down=True), 8.0, (21, Climb(1000.0, 32, down=True, looked_down=True)),
     "below paid a tenth: the new best, one step further down"),
    (32, 920.0, Climb(900.0, 48, down=True, looked_down=True), 8.0, (48, Climb(900.0, 48, 38.0, 1, looked_down=True)),
     "below about flat: back to the best limit, hold 30 s"),
    (32, 970.0, Climb(900.0, 48, down=True, looked_down=True), 8.0, (48, Climb(900.0, 48, 38.0, 1, looked_down=True)),
     "below by 8 %: within a window's noise near the knee, not enough to give up what the best limit runs"),
    (32, None, Climb(900.0, 48, down=True, looked_down=True), 8.0, (32, Climb(900.0, 48, down=True, looked_down=True)),
     "below, not judged yet: hold there"),
    (72, 800.0, Climb(900.0, 48, looked_down=True), 6.0, (48, Climb(900.0, 48, 36.0, 1, looked_down=True)),
     "it cost tokens, below looked at: back to 48, hold 30 s"),
    (72, 800.0, Climb(900.0, 48, 0.0, 2, looked_down=True), 6.0, (48, Climb(900.0, 48, 126.0, 3, looked_down=True)),
     "a third failed probe: hold 120 s"),
    (72, 800.0, Climb(900.0, 48, 0.0, 9, looked_down=True), 6.0, (48, Climb(900.0, 48, 606.0, 10, looked_down=True)),
     "never longer than max_hold_s"),
    (48, 880.0, Climb(900.0, 48, 36.0, 2), 37.0, (54, Climb(880.0, 48, 0.0, 2)), "after two failures: a step of 1/8"),
    (54, 990.0, Climb(880.0, 48, 0.0, 2), 40.0, (81, Climb(990.0, 54, looked_down=True)), "a probe that paid: failures forgotten"),
    (72, 910.0, Climb(900.0, 48), 6.0, (90, Climb(900.0, 48)), "about flat: probe on by a quarter"),
    (48, 905.0, Climb(900.0, 48, 36.0), 20.0, (48, Climb(905.0, 48, 36.0)), "holding, the best limit's rate read again"),
    (72, 820.0, Climb(900.0, 48), 6.0, (90, Climb(900.0, 48)), "9 % below is within the noise: probe on"),
    (48, 700.0, Climb(900.0, 48, 36.0), 20.0, (48, Climb(700.0, 48, 36.0)),
     "the server slowed: the bar follows it (else every probe after would read as a loss)"),
    (48, 880.0, Climb(900.0, 48, 36.0), 37.0, (72, Climb(880.0, 48)), "the hold is over: probe again from here"),
    (48, None, Climb(), 1.0, (72, Climb()), "no rate yet (the gate just opened): grow"),
])
def test_growing_stops_where_it_buys_no_more_tokens(limit, rate, climb, now, expected, why):
    sample = Sample(limit, 0)
    assert next_limit(limit, limit, sample, P, rate, climb, now) == expected, why


def test_a_failed_probe_past_a_limit_climbed_to_goes_straight_back_to_it():
    """A vLLM with 512-token answers: 256 gave 26 000 tokens/s, 384 gave 40 000, 768 gave 17 000; the limit then
    looked at 256 again (seconds of every row at 0.72 of the rate), which the climb had already measured on its way
    up. A start's own limit, reached from nothing below, is still looked below — after a second failed probe from it
    (looks below 256 after one read 0.61–0.66 of the reference)."""
    limit, climb = next_limit(384, 384, Sample(384, 0), P, 40_000.0, Climb(26_000.0, 256), 5.0)
    assert (limit, climb) == (768, Climb(40_000.0, 384, looked_down=True))
    assert next_limit(768, 768, Sample(768, 0), P, 17_000.0, climb, 9.0) == \
        (384, Climb(40_000.0, 384, 39.0, 1, looked_down=True))
    start = next_limit(256, 256, Sample(256, 0), P, 26_000.0, Climb(), 5.0)[1]
    limit, climb = next_limit(384, 384, Sample(384, 0), P, 17_000.0, start, 9.0)
    assert (limit, climb) == (256, Climb(26_000.0, 256, 39.0, 1, looked_down=True)), "the first: back and hold"
    limit, climb = next_limit(256, 256, Sample(256, 0), P, 26_000.0, climb, 40.0)
    assert (limit, climb) == (320, Climb(26_000.0, 256, failed=1)), "the hold over: a smaller probe, below not looked at"
    assert next_limit(320, 320, Sample(320, 0), P, 20_000.0, climb, 45.0) == \
        (170, Climb(26_000.0, 256, failed=1, down=True, looked_down=True)), "the second in a row: a look below"


def test_a_limit_that_cost_tokens_steps_back_though_not_all_of_it_is_in_flight():
    """A vLLM with 512-token answers: 576 in flight gave 15 000 tokens/s where 384 gave 26 000, and the limit
    stayed three valleys: the step back waited for the limit to be used, which a valley's edges rarely show."""
    got = next_limit(576, 500, Sample(500, 0), P, 15_000.0, Climb(26_000.0, 384, looked_down=True), 10.0)
    assert got == (384, Climb(26_000.0, 384, 40.0, 1, looked_down=True))


@pytest.mark.parametrize("sample, expected, why", [
    (Sample(48, 0), 48, "no queue and our limit used, but the window at 48 is too short to judge: hold"),
    (Sample(48, 40), 48 + 5, "a queue far past the wanted one, the server full: shrink at once, settled or not"),
    (Sample(48, 0, 0.99), 48, "KV cache full: hold"),
])
def test_an_unsettled_limit_only_shrinks_or_holds(sample, expected, why):
    assert next_limit(48, 48, sample, P, None, Climb(900.0, 32), 5.0, settled=False, previous=sample)[0] == expected, why


@pytest.mark.parametrize("rate, climb, expected, why", [
    (700.0, Climb(900.0, 32), (32, Climb(900.0, 32, 35.0, 1, looked_down=True)),
     "a probe up already a fifth below the best: back without waiting for its turnover, and hold"),
    (700.0, Climb(900.0, 32, failed=1), (21, Climb(900.0, 32, failed=1, down=True, looked_down=True)),
     "… the second in a row: a look below"),
    (700.0, Climb(900.0, 32, looked_down=True), (32, Climb(900.0, 32, 35.0, 1, looked_down=True)),
     "… below looked at: back to the best limit and hold"),
    (820.0, Climb(900.0, 32), (48, Climb(900.0, 32)), "a tenth below on a short window: wait for the turnover"),
    (500.0, Climb(900.0, 64, down=True, looked_down=True), (48, Climb(900.0, 64, down=True, looked_down=True)),
     "a look below is never cut short: it waits for its turnover"),
    (700.0, Climb(), (48, Climb()), "nothing to compare with yet: hold"),
])
def test_a_probe_up_clearly_worse_goes_back_before_it_settles(rate, climb, expected, why):
    assert next_limit(48, 48, Sample(48, 0), P, rate, climb, 5.0, settled=False) == expected, why


@pytest.mark.parametrize("limit, climb, expected, why", [
    (256, Climb(29_000.0, 256, 40.0, 1, looked_down=True), 256, "back from a probe up: its excess cancelled"),
    (170, Climb(29_000.0, 256, down=True, looked_down=True), 256,
     "a look below: only what the best limit does not hold is cancelled; the rest drains as answers come"),
    (282, Climb(), 282, "the server full: down to what it runs and the wanted queue"),
])
def test_what_a_falling_limit_cancels(limit, climb, expected, why):
    assert shed_to(limit, climb) == expected, why


@pytest.mark.parametrize("seconds, answered, settled, why", [
    (1.0, 500, False, "shorter than the window"),
    (3.0, 255, False, "long enough, but not a turnover of the 256 in flight answered"),
    (3.0, 256, True, "long enough and a turnover answered"),
])
def test_a_window_is_judged_after_a_turnover_of_its_limit(seconds, answered, settled, why):
    assert Window(256, 1000, 50_000.0, seconds).settled(1000 + answered) is settled, why


def test_the_follower_judges_a_limit_on_open_intervals_past_the_ramp_and_a_drained_fall():
    """The feeder's loop, sample by sample (0.5 s apart, 1 000 tokens/s, 64 in flight): a valley's first interval is
    its ramp and not counted; what the counter grew while the gate was closed is not counted; the limit is judged
    once 3 s of open time and a turnover of it are in the window; after a fall, the window opens only once what is
    in flight has drained to it."""
    f, gen, answered = Follower(P), 0.0, 0

    def step(t: float, limit: int, inflight: int, running: float | None = None) -> tuple[int, float | None]:
        return f.step(t, Sample(inflight if running is None else running, 0, None, gen), limit, inflight, answered)

    assert step(0.0, 64, 64) == (64, None), "the gate just opened: the ramp"
    for i in range(1, 4):  # 1.5 s of open time: too short to judge
        gen, answered = gen + 500, answered + 30
        assert step(0.5 * i, 64, 64) == (64, None)
    f.closed()
    gen += 99_999  # generated while closed (the counter jumps): never in a window
    assert step(10.0, 64, 64) == (64, None), "the next valley's ramp"
    for i in range(1, 4):
        gen, answered = gen + 500, answered + 30
        limit, rate = step(10.0 + 0.5 * i, 64, 64)
    assert (f.window.seconds, f.window.tokens) == (2.0, 2000.0), "1 s of each valley: its ramp interval left out"
    gen, answered = gen + 500, answered + 30
    assert step(12.0, 64, 64) == (64, None), "2.5 s: not yet"
    gen, answered = gen + 500, answered + 30
    limit, rate = step(12.5, 64, 64)
    assert rate == 1000.0 and limit == 96, "3 s and 210 answers (a turnover of 64): judged, grown by half"
    f.climb = Climb(1000.0, 96, hold_until=99.0, looked_down=True)
    assert step(13.0, 48, 96)[0] == 48 and f.window.seconds == 0, "96 in flight over a limit of 48: draining"
    gen += 500
    assert step(13.5, 48, 60)[0] == 48 and f.window.seconds == 0, "still draining"
    gen += 500
    step(14.0, 48, 48)
    gen += 500
    step(14.5, 48, 48)
    assert f.window.seconds == 0.5 and f.window.tokens == 500.0, "drained: the window counts from here"


def test_the_follower_counts_no_interval_where_its_limit_was_not_in_use():
    """The batch runs dry or its last lines are cancelled: fewer in flight than the limit uses, and the rate falls
    for want of lines, not because of the limit (a row read 512 at half of 480 as its lines were cancelled,
    and looked below). Such intervals stay out of the window, and with nothing in flight nothing is judged."""
    f, gen, answered = Follower(P), 0.0, 0
    f.climb = Climb(1000.0, 48)
    f.step(0.0, Sample(64, 0, None, gen), 64, 64, answered)  # the ramp
    for i in range(1, 3):
        gen, answered = gen + 500, answered + 40
        f.step(0.5 * i, Sample(64, 0, None, gen), 64, 64, answered)
    assert f.window.seconds == 0.5, "one interval at 64 of 64 counted (the ramp's left out)"
    for i in range(3, 20):  # the batch ran dry: 40 and then nothing in flight, the counter nearly still
        gen, answered = gen + 20, answered + 1
        inflight = 40 if i < 6 else 0
        assert f.step(0.5 * i, Sample(inflight, 0, None, gen), 64, inflight, answered) == (64, None)
    assert (f.window.seconds, f.window.tokens) == (1.0, 520.0), \
        "only the interval that began at 64 in flight: those begun at 40 or 0 of 64 are not the limit's"


def _series(server_max: int, knee: int, steps: int = 60, past: float = 0.0, start: int = 32) -> list[int]:
    """A server that runs at most ``server_max`` at once and generates in proportion to what runs up to ``knee``;
    past it the rate falls by ``past`` per doubling."""
    limit, climb, seen, previous = start, Climb(), [], None
    for t in range(steps):
        running = min(limit, server_max)
        rate = 1000.0 * min(running, knee) * (1 - past) ** math.log2(max(1.0, running / knee)) if t else None
        sample = Sample(running, limit - running)
        limit, climb = next_limit(limit, limit, sample, P, rate, climb, float(t), previous=previous)
        seen.append(limit)
        previous = sample
    return seen


def test_a_series_converges_to_the_servers_batch_plus_a_short_queue():
    """The knee past the server's bound: we send what it runs and a queue of about a tenth of that."""
    seen = _series(server_max=256, knee=10_000)
    assert seen[-1] == seen[-2] and 256 + 4 <= seen[-1] <= 256 + 2 * 26


def test_a_series_stops_past_the_compute_knee_where_more_in_flight_costs_tokens():
    """vLLM takes 1 024 at once, generates no faster past 200 and a fifth slower per doubling past it: the limit
    settles near the knee, not at 1 024."""
    seen = _series(server_max=1024, knee=200, past=0.2)
    assert max(seen[-20:]) <= 1.5 * 1.25 * 243 and min(seen[-20:]) >= 162, seen[-20:]


def test_a_start_past_the_knee_is_left_downwards():
    """This H200's vLLM with 512-token answers gave the most tokens near 128 in flight and fewer at 256 and 512 (its
    API server's CPU): started at 256, the first probe up fails, the one below pays, and the limit settles under
    256 rather than staying where it started."""
    seen = _series(server_max=1024, knee=128, past=0.2, start=256, steps=120)
    assert max(seen[-40:]) < 256 and min(seen[-40:]) >= 64, seen[-40:]


def test_probes_past_a_steep_knee_cost_less_and_less():
    """This H200's vLLM with 512-token answers: the most tokens near 384 in flight, half as many at 576 (its API
    server's CPU, not the GPU). Each probe past the knee is paid for; failed probes in a row wait longer and step
    less, so over a long run the tokens lost to probing fall (one sample a second, as the feeder's window). Before
    this, every 30 s a probe by a quarter or a half: 1.6-1.8 % of the tokens lost in this model."""
    def run(steps: int) -> tuple[float, list[int]]:
        limit, climb, lost, seen = 256, Climb(), 0.0, []
        for t in range(steps):
            rate = 1000.0 * min(limit, 384) * 0.3 ** math.log2(max(1.0, limit / 384))
            lost += 1 - rate / 384_000
            limit, climb = next_limit(limit, limit, Sample(limit, 0), P, rate if t else None, climb, float(t))
            seen.append(limit)
        return lost / steps, seen
    (early, _), (late, seen) = run(300), run(3000)
    assert late < early / 2 and late < 0.004, (early, late)  # a probe within ``fail`` of the best goes on: ~0.3 %
    assert max(seen[100:]) <= 1.15 * 384, "after two failed probes the steps are an eighth or less"


def test_a_flat_rate_past_the_knee_probes_on_to_the_servers_own_bound():
    """Flat past the knee (an API server that sets the pace, answers in waves): more in flight costs nothing, so the
    limit grows to what vLLM runs at once plus the short queue."""
    seen = _series(server_max=512, knee=200, steps=120)
    assert 512 + 4 <= seen[-1] <= 512 + 2 * 52, seen[-10:]
