"""The batch service at a dedicated GPU's pace (issue 36): a store whose counters never drift and whose grouped
writes keep every line exactly once through a ``kill -9`` between an answer and its commit; the in-flight limit's
policy on synthetic vLLM metrics; the stand-in's capacity bounded as a GPU's is."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from timeslice_verl.batch.concurrency import (Climb, Follower, Policy, Sample, Window, next_limit, parse_metrics,
                                              shed_to)
from timeslice_verl.batch.lines import parse
from timeslice_verl.batch.schema import SCHEMA_VERSION, V1
from timeslice_verl.batch.store import Outcome, Store

CHAT = "/v1/chat/completions"


def _file(n: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                                 "body": {"model": "m", "messages": []}}) for i in range(n)).encode()


def _counted(store: Store, bid: str) -> dict[str, int]:
    rows = store.query("SELECT state, COUNT(*) AS n FROM lines WHERE batch_id = ? GROUP BY state", (bid,))
    by = {r["state"]: r["n"] for r in rows}
    return {"queued": by.get("queued", 0), "inflight": by.get("inflight", 0), "completed": by.get("done", 0),
            "failed": by.get("failed", 0)}


def test_the_counters_agree_with_the_lines_through_random_claims_results_cancels_and_restarts(tmp_path):
    rng = random.Random(7)
    store = Store(tmp_path / "b.sqlite")
    bids = [store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(300), CHAT)) for _ in range(3)]
    for step in range(400):
        lines = store.claim(rng.randint(0, 20), now=1e12)
        outcomes = [Outcome(ln, rng.choice(["done", "queued", "failed"]), response='{"status_code": 200}',
                            error='{"code": "x"}', tokens=3) for ln in lines if rng.random() < 0.8]
        store.record(outcomes + outcomes[:2])  # a line answered twice is recorded once
        if step == 150:
            store.cancel(bids[1])
        if step % 97 == 0:
            store.close()
            store = Store(tmp_path / "b.sqlite")
            store.recover()
        for bid in bids:
            assert store.counts(bid) == _counted(store, bid), (step, bid)
    totals = store.totals()
    assert totals["done"] == sum(_counted(store, b)["completed"] for b in bids)


_KILLED_MID_COMMIT = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from timeslice_verl.batch.store import Outcome, Store
    store = Store(Path(sys.argv[1]))
    lines = store.claim(40, now=1e12)
    store.record([Outcome(ln, "done", response='{"first": true}', tokens=1) for ln in lines[:20]])  # committed
    store._settle = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # dies inside the next grouped write
    store.record([Outcome(ln, "done", response='{"lost": true}', tokens=1) for ln in lines[20:]])
""")


def test_a_kill_between_the_answers_and_their_grouped_commit_sends_those_lines_again_and_records_each_once(tmp_path):
    db = tmp_path / "b.sqlite"
    store = Store(db)
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(40), CHAT))
    store.close()
    child = subprocess.run([sys.executable, "-c", _KILLED_MID_COMMIT, str(db)], capture_output=True, text=True)
    assert child.returncode == -9, child.stderr

    store = Store(db)
    assert store.counts(bid) == {"queued": 0, "inflight": 20, "completed": 20, "failed": 0}
    assert store.recover() == 20
    again = store.claim(100, now=1e12)
    assert sorted(ln.custom_id for ln in again) == sorted(f"c{i}" for i in range(20, 40))
    assert all(ln.attempts == 2 for ln in again)
    store.record([Outcome(ln, "done", response='{"second": true}', tokens=1) for ln in again])
    rows = list(store.results(bid, "done"))
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(40))
    assert not any("lost" in r["response"] for r in rows)
    assert store.batch(bid)["status"] == "completed" and store.figures(bid)["retried"] == 20


def test_a_version_1_database_is_brought_forward_with_its_counters(tmp_path):
    db = sqlite3.connect(tmp_path / "b.sqlite")
    db.executescript(V1 + ";")
    db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at, "
               "total) VALUES ('batch_a', ?, 'f', '24h', 'in_progress', 0, 9999999999, 4)", (CHAT,))
    for idx, state, attempts in ((0, "done", 1), (1, "failed", 3), (2, "inflight", 1), (3, "queued", 0)):
        db.execute("INSERT INTO lines (batch_id, idx, custom_id, body, state, attempts, tokens) VALUES "
                   "('batch_a', ?, ?, '{}', ?, ?, 5)", (idx, f"c{idx}", state, attempts))
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    store = Store(tmp_path / "b.sqlite")
    assert store.counts("batch_a") == {"queued": 1, "inflight": 1, "completed": 1, "failed": 1}
    assert store.batch("batch_a")["retried"] == 2 and store.query("PRAGMA user_version")[0][0] == SCHEMA_VERSION
    assert store.recover() == 1 and [ln.custom_id for ln in store.claim(5, now=1e12)] == ["c2", "c3"]


def test_lines_go_out_oldest_batch_first_in_input_order_also_within_one_second(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    first = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(3), CHAT))
    second = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(3), CHAT))
    got = store.claim(5, now=1e12)
    assert [(ln.batch_id, ln.idx) for ln in got] == [(first, 0), (first, 1), (first, 2), (second, 0), (second, 1)]
    assert [b["id"] for b in store.batches()] == [second, first]
    assert [b["id"] for b in store.batches(after=second)] == [first]


# --------------------------------------------------------------------------- the in-flight limit


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
    (72, 800.0, Climb(900.0, 48), 6.0, (32, Climb(900.0, 48, down=True, looked_down=True)),
     "a probe up cost tokens: look once below the limit it started from (past the knee itself?)"),
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
    """Run 25 (H200, 2026-12-02, 512-token answers): 256 gave 26 000 tokens/s, 384 gave 40 000, 768 gave 17 000; the
    limit then looked at 256 again (5.7-10.4 s a row, wall clock, at 0.72 of the rate), which the climb had
    already measured on its way up. A start's own limit, reached from nothing below, is still looked below."""
    limit, climb = next_limit(384, 384, Sample(384, 0), P, 40_000.0, Climb(26_000.0, 256), 5.0)
    assert (limit, climb) == (768, Climb(40_000.0, 384, looked_down=True))
    assert next_limit(768, 768, Sample(768, 0), P, 17_000.0, climb, 9.0) == \
        (384, Climb(40_000.0, 384, 39.0, 1, looked_down=True))
    start = next_limit(256, 256, Sample(256, 0), P, 26_000.0, Climb(), 5.0)[1]
    assert next_limit(384, 384, Sample(384, 0), P, 17_000.0, start, 9.0) == \
        (170, Climb(26_000.0, 256, down=True, looked_down=True))


def test_a_limit_that_cost_tokens_steps_back_though_not_all_of_it_is_in_flight():
    """Run 12 (H200, 512-token answers): 576 in flight gave 15 000 tokens/s where 384 gave 26 000, and the limit
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
    (700.0, Climb(900.0, 32), (21, Climb(900.0, 32, down=True, looked_down=True)),
     "a probe up already a fifth below the best: back without waiting for its turnover (here, a look below)"),
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


def test_lines_claimed_ahead_and_never_sent_go_back_without_counting_a_try(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(10), CHAT))
    ahead = store.claim(6, now=1e12)
    assert store.release(ahead[2:]) == 4 and store.counts(bid) == {"queued": 8, "inflight": 2, "completed": 0, "failed": 0}
    again = store.claim(10, now=1e12)
    assert [ln.idx for ln in again] == [2, 3, 4, 5, 6, 7, 8, 9] and all(ln.attempts == 1 for ln in again)
    store.cancel(bid)
    assert store.release(again) == 8  # a cancel while they were held: they fail as never sent
    assert store.counts(bid) == {"queued": 0, "inflight": 2, "completed": 0, "failed": 8}
    assert store.figures(bid)["retried"] == 0


def test_one_batch_feeds_every_tenant_of_the_node_each_line_answered_once(tmp_path, procs):
    """Issue 36, item 5: the service follows the node's tenant list (``tenant.urls``): one queue, a feeder per
    tenant; each stand-in runs at most 8 at a time, so neither could have taken the whole batch alone."""
    from agent_support import FakeVllmProc
    from batch_support import BatchServiceProc, completed, create_batch, output_lines, write_requests

    pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")
    tenants = [FakeVllmProc("--max-num-seqs", "8", "--token-s", "0.01") for _ in range(2)]
    procs.extend(tenants)
    urls = ",".join(f'"{t.url}"' for t in tenants)
    service = BatchServiceProc(tmp_path, "", extra=(f"timeslice.tenant.urls=[{urls}]", "timeslice.batch.concurrency=8",
                                                    "timeslice.batch.adapt_concurrency=false")).start()
    procs.append(service)
    ids = write_requests(tmp_path / "in.jsonl", 400, max_tokens=lambda i: 10)
    with service.http() as http:
        batch = completed(http, create_batch(http, tmp_path / "in.jsonl"))
        answers = output_lines(http, batch)
        summary = http.get("/timeslice/summary").json()
    assert sorted(a["custom_id"] for a in answers) == ids, "every line answered, once"
    served = [t.stats()["completed"] for t in tenants]
    assert sum(served) == 400 and min(served) > 0, served
    assert [e["tenant"] for e in summary["tenants"]] == [t.url for t in tenants]
    assert [e["answered"] for e in summary["tenants"]] == served


def test_the_owner_is_no_longer_the_tenant_from_the_first_call_of_its_yield(tmp_path, procs):
    """A batch service sends only while the tenant owns the GPU. While the tenant is being paused (its ``/pause``
    answers 3 s late here) new lines would only pile into a server being stopped — and a busy API server answers the
    pause later still: the owner is ``transitioning`` from the yield's first call, the tenant still awake."""
    import threading

    from agent_support import AgentProc, FakeVllmProc, spawn_worker

    tenant = FakeVllmProc("--slow-s", "3", "--slow-on", "pause:keep")
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url).start()
    procs += [agent, spawn_worker("job-a")]
    with agent.client() as watcher, agent.client() as trainer:
        assert watcher.watch_owner("", timeout_s=5)["owner"] == "tenant"
        got: list = []
        acquire = threading.Thread(target=lambda: got.append(trainer.acquire("job-a", timeout_s=120)))
        acquire.start()
        first = watcher.watch_owner("tenant", timeout_s=30)
        acquire.join()
        trainer.release("job-a")
    assert first == {"owner": "transitioning", "tenant": "awake"}, first
    yielded = [t for t in got[0]["transitions"] if t["action"] == "tenant_yield"]
    assert yielded and yielded[-1]["ok"] and tenant.stats()["pauses"].get("keep", 0) >= 1
