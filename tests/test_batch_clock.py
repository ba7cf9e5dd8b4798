"""Every time two nodes compare is the database's: a node whose clock is off (here this process's ``time.time``,
moved) neither delays nor hastens the work of a node whose clock is right — a retry's wait, a creation's lease, an
upload's age, a batch's window, the creation order and an owner's quota window, on SQLite and on a real PostgreSQL
server."""

from __future__ import annotations

import json
import time
from typing import Iterator

import pytest

from pg_support import server, store_fixture  # noqa: F401 (server: a fixture)
from timeslice_verl.batch.files import Files
from timeslice_verl.batch.lines import RequestLine, parse
from timeslice_verl.batch.policy import Window
from timeslice_verl.batch.store import Outcome

CHAT = "/v1/completions"
HOUR, DAY = 3600.0, 86400.0


class Clock:
    """This process's ``time.time``, off by :attr:`off` seconds (the node whose clock is wrong)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.off, real = 0.0, time.time
        monkeypatch.setattr(time, "time", lambda: real() + self.off)


store = store_fixture("clock")


def _lines(n: int) -> Iterator[RequestLine]:
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
                     for i in range(n))
    return parse(text.encode(), CHAT)


def test_a_line_queued_again_by_a_node_whose_clock_is_ahead_is_ready_for_the_next_claim(store, monkeypatch):
    clock = Clock(monkeypatch)
    store.create_batch(CHAT, "f", 86400, "24h", None, _lines(1))
    (line,) = store.claim(1, "ahead")
    clock.off = HOUR
    store.again(line, 0.0)
    clock.off = 0.0
    assert [ln.custom_id for ln in store.claim(1, "right")] == ["c0"]


def test_a_creation_by_a_node_whose_clock_is_behind_is_not_taken_over_while_it_runs(store, monkeypatch):
    clock = Clock(monkeypatch)

    def lines() -> Iterator[RequestLine]:
        yield from _lines(1)
        clock.off = 0.0  # meanwhile another node looks for creations whose creator is gone
        store.recover(everything=False)
        clock.off = -HOUR
        yield RequestLine(2, "c1", json.dumps({"model": "m"}))

    clock.off = -HOUR
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, lines())
    assert store.batch(bid)["status"] == "in_progress" and store.counts(bid)["queued"] == 2


def test_an_upload_by_a_node_whose_clock_is_behind_is_not_swept_by_another(store, monkeypatch):
    clock, files = Clock(monkeypatch), Files(store)
    clock.off = -HOUR
    upload = files.writer(1 << 20)
    upload.add(b'{"custom_id": "c0"}\n')
    clock.off = 0.0
    assert files.sweep(idle_s=60) == 0, "an upload written to just now is kept"
    assert upload.finish("batch", "in.jsonl")["bytes"] == 20


def test_a_batch_created_by_a_node_whose_clock_is_behind_keeps_its_window(store, monkeypatch):
    clock = Clock(monkeypatch)
    clock.off = -2 * DAY
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, _lines(1))
    clock.off = 0.0
    store.settle_open()
    assert store.batch(bid)["status"] == "in_progress"


def test_the_creation_order_is_the_databases_whatever_the_creators_clocks(store, monkeypatch):
    clock = Clock(monkeypatch)
    first = store.create_batch(CHAT, "f", 86400, "24h", None, _lines(1))
    clock.off = -HOUR
    second = store.create_batch(CHAT, "f", 86400, "24h", None, _lines(1))
    clock.off = 0.0
    assert [b["id"] for b in store.batches()] == [second, first], "newest first"
    assert [b["id"] for b in store.batches(after=second)] == [first]
    assert [ln.batch_id for ln in store.claim(2)] == [first, second]


def test_an_owners_answers_count_toward_its_quota_whatever_the_clock_of_the_node_that_ended_its_batch(store,
                                                                                                     monkeypatch):
    clock = Clock(monkeypatch)
    clock.off = -2 * DAY
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, _lines(2), owner="team-a")
    store.record([Outcome(ln, "done", response='{"ok": true}', tokens=5) for ln in store.claim(2, "behind")])
    assert store.batch(bid)["status"] == "completed"
    clock.off = 0.0
    assert store.queue.quotas.usage("team-a") == {Window.hour: 10, Window.day: 10}
