"""A batch's deadline: ``completion_window`` as OpenAI's ``24h`` or shorter (``1h``, ``90m``), a clear 400 otherwise;
within a priority the earliest deadline is claimed first; a batch past its window ends ``expired`` with the lines
answered in its output file and the rest in its error file (``batch_expired``), each line once — the window's end
written in the database rather than waited for, on SQLite and a real PostgreSQL server."""

from __future__ import annotations

import json

import pytest

from pg_support import server, service_app, store_fixture  # noqa: F401 (server: a fixture)

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.bodies import window_seconds  # noqa: E402
from timeslice_verl.batch.store import Outcome, Store  # noqa: E402

CHAT = "/v1/chat/completions"


store = store_fixture("deadlines")


@pytest.fixture
def client(store):
    app = service_app(store)
    with TestClient(app) as c:
        yield c


def _create(client: TestClient, n: int, window: str, prefix: str = "r", **extra) -> dict:
    lines = "".join(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": CHAT,
                                "body": {"model": "m", "messages": []}}) + "\n" for i in range(n))
    fid = client.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"}).json()["id"]
    made = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": window,
                                            **extra})
    assert made.status_code == 200, made.text
    return made.json()


@pytest.mark.parametrize("window, seconds", [("24h", 86400), ("1h", 3600), ("4h", 14400), ("90m", 5400),
                                             ("5m", 300), ("1440m", 86400)])
def test_a_completion_window_of_hours_or_minutes_up_to_a_day_is_taken(window, seconds):
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["48h", "25h", "4m", "0h", "1.5h", "2d", "h", "24 h", "-1h", "01h", "", "24H"])
def test_another_completion_window_is_a_400_naming_what_is_taken(store, client, window):
    fid = client.post("/v1/files", files={"file": ("in.jsonl", b'{"custom_id": "a", "method": "POST", "url": "'
                                                   + CHAT.encode() + b'", "body": {"model": "m"}}\n')},
                      data={"purpose": "batch"}).json()["id"]
    resp = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": window})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "completion_window" and f"completion_window {window!r} is not supported" in error["message"]
    assert "'24h'" in error["message"] and "5m to 24h" in error["message"]
    assert store.batches() == []


def test_a_batch_expires_its_window_after_its_creation(client):
    made = _create(client, 1, "90m")
    assert made["completion_window"] == "90m" and made["expires_at"] - made["created_at"] == 5400


def test_within_a_priority_the_earliest_deadline_is_claimed_first(store, client):
    day, hour, four = (_create(client, 3, w, prefix=w)["id"] for w in ("24h", "1h", "4h"))
    urgent = _create(client, 2, "24h", prefix="p", priority=-1)["id"]  # a lower priority waits, whatever its window
    got = store.claim(11, "n")
    assert [ln.batch_id for ln in got] == [hour] * 3 + [four] * 3 + [day] * 3 + [urgent] * 2
    assert [ln.custom_id for ln in got[:3]] == ["1h0", "1h1", "1h2"], "input order within a batch"


def test_owners_tied_on_the_share_go_earliest_deadline_first(store):
    from timeslice_verl.batch.lines import parse

    def batch(owner: str, window_s: int) -> str:
        text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
                         for i in range(4))
        return store.create_batch(CHAT, "f", window_s, "w", None, parse(text.encode(), CHAT), owner=owner)

    late, soon = batch("k1", 86400), batch("k2", 3600)
    got = store.claim(3, "n")
    assert [ln.batch_id for ln in got] == [soon, soon, late], "k2 (sooner) first at the tie, then the share evens"


def _expire(store: Store, bid: str) -> None:
    """The batch's window ends now: its end written in the database, as its clock would bring it (a second before
    its creation, on that clock)."""
    with store.transaction() as db:
        db.execute("UPDATE batches SET expires_at = created_at - 1 WHERE id = ?", (bid,))


def test_a_batch_past_its_window_ends_expired_with_its_answers_and_the_rest_reported_once(store, client):
    made = _create(client, 6, "1h")
    bid = made["id"]
    sent = store.claim(4, "n")
    store.record([Outcome(ln, "done", response=json.dumps({"status_code": 200, "body": {"n": ln.idx}}), tokens=3)
                  for ln in sent[:3]])  # 3 answered, 1 still in flight, 2 never sent
    _expire(store, bid)
    store.settle_open()
    assert client.get(f"/v1/batches/{bid}").json()["status"] == "cancelling", "the line in flight is awaited"
    assert store.claim(10, "n") == [], "nothing more is sent"
    store.record([Outcome(sent[3], "done", response=json.dumps({"status_code": 200, "body": {"n": 3}}), tokens=3)])
    store.settle_open()
    store.settle_open()  # once ended, nothing moves again
    batch = client.get(f"/v1/batches/{bid}").json()
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert batch["request_counts"] == {"total": 6, "completed": 4, "failed": 0}, "the lines never sent: neither"
    out = [json.loads(x) for x in client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
    err = [json.loads(x) for x in client.get(f"/v1/files/{batch['error_file_id']}/content").text.splitlines()]
    assert [x["custom_id"] for x in out] == ["r0", "r1", "r2", "r3"]
    assert [x["custom_id"] for x in err] == ["r4", "r5"] and {x["error"]["code"] for x in err} == {"batch_expired"}
    assert store.figures(bid)["failed"] == {"batch_expired": 2}
