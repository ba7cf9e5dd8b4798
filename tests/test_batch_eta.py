"""A batch's ETA: the measured speed (tokens per open second while work waited, the share of wall time the gate was
open), the work ahead of a batch as the claim orders it, the ``timeslice_eta`` field of the batch object as lines
complete, a batch that cannot meet its window flagged (or refused, where its owner's key policy says so), and a cold
service that flags nothing — the pure part as tables, the API on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import json

import pytest

from pg_support import server, service_app, store_fixture  # noqa: F401 (server: a fixture)

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.auth import RequireKey  # noqa: E402
from timeslice_verl.batch.estimates import COLD  # noqa: E402
from timeslice_verl.batch.eta import (  # noqa: E402
    PRIOR_LINES, Basis, Meter, Rate, Sample, Work, asked_per_line, estimate, late, per_line)
from timeslice_verl.batch.lines import asked_tokens  # noqa: E402
from timeslice_verl.batch.keys import parse_keys  # noqa: E402
from timeslice_verl.batch.policy import PolicyError, parse_field  # noqa: E402

CHAT = "/v1/chat/completions"
ADMIN, STRICT = "admin-key-0123456789", "strict-key-0123456789"
KEY_FILE = f"{ADMIN}\n{STRICT} owner=strict refuse_late=true\n"

store = store_fixture("eta")

# --------------------------------------------------------------------------- the measurement


def _steady(meter: Meter, seconds: int, share: float = 0.5, tokens_per_open_s: float = 100.0,
            tokens_per_line: float = 10.0, backlog: int = 50, start: int = 0) -> None:
    """Samples every 2 s of a service whose gate is open ``share`` of the time, answering at that speed."""
    for t in range(start, start + seconds + 1, 2):
        opened = t * share
        tokens = opened * tokens_per_open_s
        meter.add(Sample(float(t), opened, int(tokens), int(tokens / tokens_per_line), backlog))


def test_the_meter_gives_the_speed_per_open_second_and_the_share_of_wall_time_open():
    meter = Meter()
    _steady(meter, 120, share=0.4, tokens_per_open_s=200.0, tokens_per_line=20.0)
    rate = meter.rate()
    assert rate is not None and rate.basis is Basis.tokens
    assert rate.tokens_per_open_s == pytest.approx(200.0, rel=0.02) and rate.open_share == pytest.approx(0.4)
    assert rate.tokens_per_line == pytest.approx(20.0, rel=0.02)
    assert rate.per_wall_s() == pytest.approx(80.0, rel=0.02)


@pytest.mark.parametrize("seconds, share, backlog, measured", [
    (10, 0.5, 50, False),   # too short a span for the share
    (120, 0.02, 50, False),  # the gate open too little to measure the speed
    (120, 0.5, 0, False),   # nothing waited: the speed of the arrivals, not of the service
    (120, 0.5, 50, True),
])
def test_the_meter_gives_nothing_until_it_rests_on_enough(seconds, share, backlog, measured):
    meter = Meter()
    _steady(meter, seconds, share=share, backlog=backlog)
    assert (meter.rate() is not None) is measured


def test_the_meter_forgets_what_is_older_than_its_window_and_starts_over_on_counters_that_went_back():
    meter = Meter(window_s=60.0)
    _steady(meter, 200, tokens_per_open_s=100.0)
    _steady(meter, 100, tokens_per_open_s=300.0, start=202)  # counters went back (a restart): only the new speed
    assert meter.rate().tokens_per_open_s == pytest.approx(300.0, rel=0.05)
    assert meter.samples[-1].at - meter.samples[0].at <= 62.0


def test_an_interval_with_nothing_waiting_counts_for_the_share_alone():
    meter = Meter()
    for t in range(0, 61, 2):  # busy for a minute at 100 tokens per open second, the gate open half the time
        meter.add(Sample(float(t), t * 0.5, int(t * 50), int(t * 5), 10))
    for t in range(62, 121, 2):  # then idle, the gate open all the time: the share rises, the speed stays
        meter.add(Sample(float(t), 30.0 + (t - 60), 3000, 300, 0))
    rate = meter.rate()
    assert rate.tokens_per_open_s == pytest.approx(100.0) and rate.open_share == pytest.approx(0.75)


def test_the_meter_measures_the_tokens_generated_per_token_asked_over_its_window():
    meter = Meter()
    for t in range(0, 121, 2):  # lines asking 64 tokens each, answered with 16: a quarter of what they ask
        meter.add(Sample(float(t), t * 0.5, t * 40, t * 2, 10, asked=t * 2 * 64.0, asked_out=t * 2 * 16))
    assert meter.rate().fill == pytest.approx(0.25)
    plain = Meter()
    _steady(plain, 120)  # no line names a limit: nothing to measure
    assert plain.rate().fill is None


# --------------------------------------------------------------------------- the estimate

RATE = Rate(tokens_per_open_s=200.0, lines_per_open_s=10.0, open_share=0.5, tokens_per_line=20.0, window_s=300.0)
"""100 tokens per wall second; a line of a batch without answers yet costs 20 tokens."""


@pytest.mark.parametrize("batches, expected", [
    # alone: 50 lines x 20 tokens at 100 tokens/s
    ([Work("a", 0, "x", 1, 1e9, 50)], {"a": 10.0}),
    # its own mean so far (40 tokens a line) rather than the service's
    ([Work("a", 0, "x", 1, 1e9, 50, answered=10, tokens=400)], {"a": 20.0}),
    # a higher priority goes first, whatever its age
    ([Work("a", 0, "x", 1, 1e9, 50), Work("b", 5, "x", 2, 1e9, 50)], {"b": 10.0, "a": 20.0}),
    # one owner: earliest deadline first, then creation order
    ([Work("a", 0, "x", 1, 1e9, 50), Work("b", 0, "x", 2, 5e8, 50), Work("c", 0, "x", 3, 1e9, 50)],
     {"b": 10.0, "a": 20.0, "c": 30.0}),
    # two owners share the speed: each at 50 tokens/s until the first ends, then the other alone
    ([Work("a", 0, "x", 1, 1e9, 50), Work("b", 0, "y", 2, 1e9, 100)], {"a": 20.0, "b": 30.0}),
    # by weight: y (weight 3) at 75 tokens/s, x at 25 (500 of its 1000 tokens by then, the rest at 100/s)
    ([Work("a", 0, "x", 1, 1e9, 50), Work("b", 0, "y", 2, 1e9, 75, weight=3.0)], {"b": 20.0, "a": 25.0}),
    # nothing left (its last lines being written): it ends now, and holds nobody up
    ([Work("a", 0, "x", 1, 1e9, 0), Work("b", 0, "x", 2, 1e9, 50)], {"a": 0.0, "b": 10.0}),
])
def test_the_estimate_counts_the_work_ahead_as_the_claim_orders_it(batches, expected):
    got = estimate(batches, RATE)
    assert got == pytest.approx(expected)


FILLED = Rate(tokens_per_open_s=200.0, lines_per_open_s=10.0, open_share=0.5, tokens_per_line=20.0, window_s=300.0,
              fill=0.5)
"""As :data:`RATE`, and answers recently generated half the tokens their lines asked for."""


@pytest.mark.parametrize("work, rate, expected", [
    # no limit named: its own mean once it has answers, the service's before
    (Work("a", 0, "x", 1, 1e9, 50), RATE, 20.0),
    (Work("a", 0, "x", 1, 1e9, 50, answered=10, tokens=400), RATE, 40.0),
    # what its lines ask for, times the share answers generate of it: the service's mean has no say
    (Work("a", 0, "x", 1, 1e9, 50, asked=64.0), FILLED, 32.0),
    (Work("a", 0, "x", 1, 1e9, 50, asked=16.0), FILLED, 8.0),
    # that share not measured yet: what they ask for, at most the service's mean
    (Work("a", 0, "x", 1, 1e9, 50, asked=64.0), RATE, 20.0),
    (Work("a", 0, "x", 1, 1e9, 50, asked=16.0), RATE, 16.0),
    # its own answers weigh in as they come: PRIOR_LINES of them as much as the prior, ten times as many decide it
    (Work("a", 0, "x", 1, 1e9, 50, answered=int(PRIOR_LINES), tokens=int(PRIOR_LINES) * 10, asked=64.0), FILLED, 21.0),
    (Work("a", 0, "x", 1, 1e9, 50, answered=int(PRIOR_LINES) * 9, tokens=int(PRIOR_LINES) * 90, asked=64.0), FILLED,
     12.2),
    # answers without usage say nothing of tokens: the prior alone
    (Work("a", 0, "x", 1, 1e9, 50, answered=10, tokens=0, asked=64.0), FILLED, 32.0),
])
def test_a_lines_tokens_start_from_what_it_asks_for_and_move_to_its_own_answers(work, rate, expected):
    assert per_line(work, rate) == pytest.approx(expected)


def test_the_work_ahead_counts_what_its_lines_ask_for():
    """A batch asking for 16 tokens a line ahead of one asking for 64: each at its own size, not the service's mean."""
    got = estimate([Work("a", 0, "x", 1, 1e9, 100, asked=16.0), Work("b", 0, "x", 2, 1e9, 100, asked=64.0)], FILLED)
    assert got == pytest.approx({"a": 8.0, "b": 40.0})  # 800 tokens, then 3200, at 100 tokens/s


@pytest.mark.parametrize("endpoint, body, expected", [
    (CHAT, {"max_completion_tokens": 300}, 300),
    (CHAT, {"max_tokens": 200}, 200),
    (CHAT, {"max_completion_tokens": 300, "max_tokens": 200}, 300),  # the newer field counts
    (CHAT, {"max_completion_tokens": None, "max_tokens": 200}, 200),
    ("/v1/completions", {"max_tokens": 64, "n": 3}, 192),  # every choice is generated
    ("/v1/completions", {"max_tokens": 64, "n": None}, 64),
    ("/v1/completions", {"max_completion_tokens": 64}, None),  # not a field of completions
    (CHAT, {}, None),  # no limit: the model's own, unknown here
    (CHAT, {"max_tokens": 0}, None),
    (CHAT, {"max_tokens": True}, None),
    (CHAT, {"max_tokens": "64"}, None),
    (CHAT, {"max_tokens": 64, "n": 0}, None),
])
def test_what_a_line_asks_for_is_its_limit_times_its_choices(endpoint, body, expected):
    assert asked_tokens({"model": "m", **body}, endpoint) == expected


@pytest.mark.parametrize("asked_tokens_, asked_lines, expected", [(640, 10, 64.0), (0, 0, None), (100, 3, 100 / 3)])
def test_a_batchs_tokens_asked_a_line_come_from_its_counters(asked_tokens_, asked_lines, expected):
    assert asked_per_line(asked_tokens_, asked_lines) == (pytest.approx(expected) if expected else None)


def test_without_usage_the_estimate_counts_lines_and_without_a_measurement_there_is_none():
    lines = Rate(0.0, 10.0, 0.5, None, 300.0)
    assert lines.basis is Basis.lines
    assert estimate([Work("a", 0, "x", 1, 1e9, 50)], lines) == {"a": 10.0}
    assert estimate([Work("a", 0, "x", 1, 1e9, 50)], None) == {}
    assert estimate([Work("a", 0, "x", 1, 1e9, 50)], Rate(200.0, 10.0, 0.0, 20.0, 300.0)) == {}  # never open
    assert RATE.with_share(0.25).per_wall_s() == pytest.approx(50.0) and RATE.with_share(None) is RATE


@pytest.mark.parametrize("eta_s, now, deadline, expected", [
    (10.0, 100.0, 120.0, False), (30.0, 100.0, 120.0, True), (None, 100.0, 120.0, None)])
def test_late_means_past_the_end_of_the_window(eta_s, now, deadline, expected):
    assert late(eta_s, now, deadline) is expected


def test_refuse_late_is_read_from_the_key_file_as_true_or_false():
    assert parse_field("refuse_late", "true") is True and parse_field("refuse_late", "false") is False
    with pytest.raises(PolicyError, match="refuse_late='yes' is not true or false"):
        parse_field("refuse_late", "yes")
    keys = parse_keys(KEY_FILE.splitlines(), "keys")
    assert [k.policy.refuse_late for k in keys] == [False, True]


# --------------------------------------------------------------------------- the API, on both engines


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create(client: TestClient, key: str, lines: int, window: str = "24h", **limits: int):
    body = {"model": "m", "messages": [], **limits}
    content = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body}) + "\n"
                      for i in range(lines)).encode()
    fid = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"},
                      headers=_as(key)).json()["id"]
    return client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": window},
                       headers=_as(key))


def _client(store, rate: Rate | None) -> TestClient:
    return TestClient(RequireKey(service_app(store, rate=lambda: rate), parse_keys(KEY_FILE.splitlines(), "keys")))


def test_the_eta_appears_and_moves_as_lines_complete(store):
    with _client(store, RATE) as api:
        made = _create(api, ADMIN, 40)
        assert made.status_code == 200, made.text
        bid, first = made.json()["id"], made.json()["timeslice_eta"]
        assert first["basis"] == "tokens" and first["eta_s"] == pytest.approx(8.0) and first["late"] is False
        assert first["eta_at"] >= made.json()["created_at"] + 8
        for line in store.claim(20):  # half answered, 30 tokens each: its own mean now, 20 lines x 30 tokens left
            store.done(line, {"choices": []}, 30)
        now = api.get(f"/v1/batches/{bid}", headers=_as(ADMIN)).json()["timeslice_eta"]
        assert now["eta_s"] == pytest.approx(6.0)
        listed = api.get("/v1/batches", headers=_as(ADMIN)).json()["data"][0]["timeslice_eta"]
        assert listed["eta_s"] == pytest.approx(6.0)
        for line in store.claim(20):
            store.done(line, {"choices": []}, 30)
        ended = api.get(f"/v1/batches/{bid}", headers=_as(ADMIN)).json()
        assert ended["status"] == "completed" and ended["timeslice_eta"] == {
            "eta_at": None, "eta_s": None, "basis": "ended", "late": None, "why": None}


def test_a_batch_that_cannot_meet_its_window_is_flagged_and_the_work_ahead_counts(store):
    slow = Rate(tokens_per_open_s=2.0, lines_per_open_s=0.1, open_share=0.5, tokens_per_line=20.0, window_s=300.0)
    with _client(store, slow) as api:  # 10 lines: 200 tokens at 1 token/s, 200 s: within a 5-minute window
        alone = _create(api, ADMIN, 10, "5m").json()["timeslice_eta"]
        assert alone["late"] is False and alone["why"] is None
        behind = _create(api, ADMIN, 10, "5m").json()  # the first batch's deadline is earlier: 400 s, past 300
        assert behind["status"] == "in_progress" and behind["timeslice_eta"]["late"] is True
        assert behind["timeslice_eta"]["eta_s"] == pytest.approx(400.0)
        assert "completion_window '5m'" in behind["timeslice_eta"]["why"] and "400 s" in behind["timeslice_eta"]["why"]


def test_refuse_late_answers_4xx_naming_the_window_and_the_eta_and_makes_nothing(store):
    slow = Rate(tokens_per_open_s=2.0, lines_per_open_s=0.1, open_share=0.5, tokens_per_line=20.0, window_s=300.0)
    with _client(store, slow) as api:
        refused = _create(api, STRICT, 20, "5m")  # 400 s of work in a 300 s window
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "completion_window_too_short" and error["param"] == "completion_window"
        assert "completion_window '5m'" in error["message"] and "should end in 400 s" in error["message"]
        assert api.get("/v1/batches", headers=_as(ADMIN)).json()["data"] == []
        assert store.totals()["queued"] == 0 and store.query(store.dialect.sql("eta_open"), ("batch",)) == []
        assert _create(api, STRICT, 10, "5m").status_code == 200  # one that fits is made
        assert _create(api, ADMIN, 20, "5m").json()["timeslice_eta"]["late"] is True  # another owner's: flagged only


def test_a_batchs_eta_at_creation_rests_on_what_its_lines_ask_for_and_refuse_late_reads_it(store):
    with _client(store, FILLED) as api:  # 40 lines asking 50 tokens, half generated: 1000 tokens at 100 tokens/s
        made = _create(api, ADMIN, 40, max_tokens=50).json()
        assert made["timeslice_eta"]["eta_s"] == pytest.approx(10.0)
        row = store.batch(made["id"])
        assert (row["asked_tokens"], row["asked_lines"]) == (2000, 40)
        # 200 lines asking 500: 50 000 tokens, 500 s, past a 5-minute window (the service's mean would make it 40 s)
        refused = _create(api, STRICT, 200, "5m", max_completion_tokens=500)
        assert refused.status_code == 400 and "should end in 510 s" in refused.json()["error"]["message"]
        assert _create(api, STRICT, 200, "5m", max_completion_tokens=50).status_code == 200


def test_a_cold_service_flags_nothing_and_says_so(store):
    with _client(store, None) as api:
        strict = _create(api, STRICT, 500, "5m")
        assert strict.status_code == 200, strict.text
        field = strict.json()["timeslice_eta"]
        assert field == {"eta_at": None, "eta_s": None, "basis": "cold", "late": None, "why": COLD}
        assert "nothing is flagged" in COLD


# --------------------------------------------------------------------------- what the commands show


def test_batch_status_and_the_nodes_status_show_the_eta_and_a_late_flag():
    from timeslice_verl.batch.client import describe, eta_words
    from timeslice_verl.tools.status import render_batch

    batch = {"id": "batch_1", "status": "in_progress", "endpoint": CHAT, "request_counts": {"total": 10, "completed": 4,
             "failed": 0}, "timeslice_eta": {"eta_at": 1, "eta_s": 600.0, "basis": "tokens", "late": True, "why": "w"}}
    assert "ETA 10 min — LATE: past the end of its completion_window" in describe(batch)
    assert eta_words({"eta_s": None, "basis": "cold"}) == "ETA: not measured yet"
    assert eta_words({"basis": "ended"}) == "" and eta_words(None) == ""
    shown = render_batch({"tenant": "http://t", "gate": {"open": True, "source": "agent"}, "lines": {},
                          "speed": {"basis": "tokens", "tokens_per_open_s": 250.0, "lines_per_open_s": 8.0,
                                    "open_share": 0.42, "window_s": 300.0},
                          "open_batches": [{"id": "batch_1", "status": "in_progress", "total": 10, "completed": 4,
                                            "timeslice_eta": {"eta_s": 45.0, "late": False, "basis": "tokens"}}]})
    assert "250 tokens/s while sending, the gate open 42 % of the time" in shown
    assert "4/10 (40 %), 0 failed, ETA 45 s" in shown


def test_the_services_status_json_carries_each_open_batchs_eta_and_a_fresh_service_is_cold(tmp_path, procs):
    from batch_support import BatchServiceProc, create_batch, write_requests
    from timeslice_verl.standin.server import StandinServer

    tenant = StandinServer(model="m").start()
    tenant.engine.pause("keep")  # nothing is answered: the service measures nothing, the batch stays open
    try:
        service = BatchServiceProc(tmp_path, tenant.url).start()
        procs.append(service)
        write_requests(tmp_path / "in.jsonl", 3)
        bid = create_batch(service.http(), tmp_path / "in.jsonl")
        summary = service.get("/timeslice/summary")
        assert summary["speed"] is None
        assert [(b["id"], b["timeslice_eta"]["basis"], b["timeslice_eta"]["late"]) for b in summary["open_batches"]] == \
            [(bid, "cold", None)]
    finally:
        tenant.engine.resume()
        tenant.stop()
