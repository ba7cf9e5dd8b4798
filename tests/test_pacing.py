"""Sends spread over an answer's time (``timeslice.batch.spread``): the pacer's arithmetic on a given clock,
the answer time's running mean, and a real batch service with the setting on answering every line once."""

from __future__ import annotations

import json

import pytest

from timeslice_verl.batch.pacing import BURST_SHARE, HEADROOM, Latency, Pacer


@pytest.mark.parametrize("calls, expected, why", [
    ([(0.0, 64, 64, None)], [64], "no answer yet: nothing is held back"),
    ([(0.0, 64, 64, 0.0)], [64], "an answer time of 0 says nothing: nothing is held back"),
    ([(0.0, 0, 64, 1.0), (0.0, -3, 64, 1.0)], [0, 0], "nothing wanted, nothing sent"),
    ([(0.0, 64, 64, 1.0)], [8], "at first a share of the limit goes at once"),
    ([(0.0, 64, 64, 1.0), (0.0, 56, 64, 1.0)], [8, 0], "the bucket is empty in the same instant"),
    ([(0.0, 64, 64, 1.0), (0.05, 56, 64, 1.0)], [8, 4], "refilled at 1.25 × 64 per second: 4 in 50 ms"),
    ([(0.0, 64, 64, 1.0), (60.0, 64, 64, 1.0)], [8, 8], "a bucket never holds more than its share of the limit"),
    ([(0.0, 2, 64, 1.0), (0.0, 64, 64, 1.0)], [2, 6], "what one call took, the next cannot"),
    ([(0.0, 64, 4, 1.0)], [1], "at least one send at once"),
    ([(0.0, 8, 64, 1.0), (1.0, 8, 64, 1.0), (0.5, 8, 64, 1.0)], [8, 8, 0], "a clock read out of order adds nothing"),
])
def test_the_pacer_releases_sends_at_the_limits_pace(calls, expected, why):
    pacer = Pacer()
    assert [pacer.allow(now, want, limit, answer_s) for now, want, limit, answer_s in calls] == expected, why


def test_the_pacer_never_holds_the_limit_below_itself():
    """Asked every millisecond for as many as it can give, over one answer's time it lets out more than the limit
    (a refill after a wave is spread, never cut), and no more than its bucket plus HEADROOM × the limit."""
    for limit, answer_s in ((8, 0.2), (384, 0.9), (512, 12.0)):
        pacer, sent, steps = Pacer(), 0, round(answer_s * 1000)
        for i in range(steps + 1):
            sent += pacer.allow(i / 1000, 10**6, limit, answer_s)
        assert limit <= sent <= max(1.0, BURST_SHARE * limit) + HEADROOM * limit + 1, (limit, sent)


@pytest.mark.parametrize("tokens, limit, answer_s, expected", [
    (0.0, 64, 1.0, 1 / 80), (0.5, 64, 1.0, 0.5 / 80), (1.0, 64, 1.0, 0.0), (0.0, 64, None, 0.0), (0.0, 0, 1.0, 1 / 1.25),
])
def test_the_pacer_says_when_its_next_send_may_go(tokens, limit, answer_s, expected):
    assert Pacer(tokens=tokens, at=0.0).wait_s(limit, answer_s) == pytest.approx(expected)


def test_the_answer_time_is_a_running_mean_that_ignores_nonsense():
    latency = Latency()
    assert latency.mean_s is None
    latency.add(2.0)
    assert latency.mean_s == 2.0, "the first answer sets it"
    latency.add(4.0)
    assert latency.mean_s == pytest.approx(2.1)
    for bad in (-1.0, float("inf"), float("nan")):
        latency.add(bad)
    assert latency.mean_s == pytest.approx(2.1)


def test_a_service_with_spread_sends_answers_every_line_once(tmp_path, procs):
    """``timeslice.batch.spread=true`` on a real batch service and a stand-in vLLM whose answers are all one length:
    every line answered, once, none failed; the setting reaches the feeder (its ``/timeslice/summary``)."""
    from agent_support import FakeVllmProc
    from batch_support import BatchServiceProc, completed, create_batch, output_lines, write_requests

    pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")
    tenant = FakeVllmProc("--max-num-seqs", "32", "--token-s", "0.002")
    procs.append(tenant)
    service = BatchServiceProc(tmp_path, tenant.url, extra=("timeslice.batch.concurrency=64",
                                                            "timeslice.batch.spread=true")).start()
    procs.append(service)
    ids = write_requests(tmp_path / "in.jsonl", 600, max_tokens=lambda i: 8)
    with service.http() as http:
        batch = completed(http, create_batch(http, tmp_path / "in.jsonl"))
        answers = output_lines(http, batch)
        feeder = http.get("/timeslice/summary").json()["feeder"]
    assert sorted(a["custom_id"] for a in answers) == ids, "every line answered, once"
    assert batch["request_counts"] == {"total": 600, "completed": 600, "failed": 0}
    assert feeder["spread"] is True and feeder["answer_s"] is not None
    assert tenant.stats()["completed"] == 600


def test_an_answers_time_counts_only_the_gates_open_seconds(tmp_path, procs):
    """The answer time the pacer paces by is taken on the gate's open-seconds clock: a request held through a
    trainer's turn (the gate closed) took the server no longer. Here that clock reads 10.0 at the send and 10.5 at
    the answer, whatever the wall clock did."""
    import asyncio

    import aiohttp
    from agent_support import FakeVllmProc

    from timeslice_verl.batch.concurrency import Policy
    from timeslice_verl.batch.feeder import Feeder
    from timeslice_verl.batch.gate import Gate
    from timeslice_verl.batch.lines import parse
    from timeslice_verl.batch.store import Store

    tenant = FakeVllmProc()
    procs.append(tenant)
    store = Store(tmp_path / "b.sqlite")
    body = json.dumps({"custom_id": "c0", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "x", "max_tokens": 2}}).encode()
    store.create_batch("/v1/completions", "f", 86400, "24h", None, parse(body, "/v1/completions"))
    gate = Gate(None)
    reads = iter([10.0, 10.5])
    gate.seconds_open = lambda: next(reads)  # type: ignore[method-assign]

    async def run() -> float | None:
        feeder = Feeder(store, tenant.url, gate, policy=Policy(start=1), adapt=False, spread=True)
        async with aiohttp.ClientSession(tenant.url) as session:
            (line,) = store.claim(1)
            feeder._launch(session, line)
            for _ in range(6000):  # a guard against a hang, no measurement
                if feeder.stats.inflight == 0:
                    break
                await asyncio.sleep(0.01)
        return feeder.latency.mean_s

    assert asyncio.run(run()) == pytest.approx(0.5)
