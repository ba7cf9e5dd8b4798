"""One batch queue for a cluster. The store's contract on both engines (SQLite for one node, a real
PostgreSQL server for many), the claim's share between priorities and owners, and one 20 000-line batch consumed by
three nodes while a feeder is killed, an API replica is killed and the database restarts."""

from __future__ import annotations

import json
import os
import time

import pytest

from pg_support import server, store_fixture  # noqa: F401 (server: a fixture)
from timeslice_verl.batch.lines import parse
from timeslice_verl.batch.share import Waiting, plan
from timeslice_verl.batch.store import Outcome, Store

CHAT = "/v1/completions"


@pytest.mark.parametrize("batches, n, want", [
    ([], 10, []),
    ([Waiting("a", 0, "k1", 1, 5, 0)], 10, [("a", 5)]),
    # one owner: creation order
    ([Waiting("a", 0, "k1", 1, 5, 0), Waiting("b", 0, "k1", 2, 5, 0)], 7, [("a", 5), ("b", 2)]),
    # two owners share, whatever the order of creation
    ([Waiting("a", 0, "k1", 1, 100, 0), Waiting("b", 0, "k2", 2, 100, 0)], 10, [("a", 5), ("b", 5)]),
    # the owner with fewer in flight catches up first
    ([Waiting("a", 0, "k1", 1, 100, 8), Waiting("b", 0, "k2", 2, 100, 0)], 10, [("a", 1), ("b", 9)]),
    # what one owner cannot use goes to the other
    ([Waiting("a", 0, "k1", 1, 2, 0), Waiting("b", 0, "k2", 2, 100, 0)], 10, [("a", 2), ("b", 8)]),
    # a higher priority first, all of it
    ([Waiting("a", 0, "k1", 1, 100, 0), Waiting("v", 10, "k2", 5, 4, 0)], 10, [("v", 4), ("a", 6)]),
])
def test_a_claim_takes_priority_first_then_shares_between_owners_then_creation_order(batches, n, want):
    assert plan(batches, n) == want


store = store_fixture("t")


def _batch(store: Store, n: int, owner: str = "", priority: int = 0) -> str:
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
                     for i in range(n))
    return store.create_batch(CHAT, "f", 86400, "24h", None, parse(text.encode(), CHAT), owner=owner, priority=priority)


def test_an_answer_from_a_holder_whose_lease_was_taken_over_is_discarded(store):
    bid = _batch(store, 3)
    first = store.claim(3, "node-a", lease_s=-1.0)  # a lease already run out: node-a is gone
    assert [ln.token for ln in first] == [1, 1, 1]
    assert store.recover(everything=False) == 3
    second = store.claim(3, "node-b")
    assert [ln.custom_id for ln in second] == ["c0", "c1", "c2"] and {ln.token for ln in second} == {2}
    assert store.record([Outcome(first[0], "done", response='{"late": true}', tokens=1)]) == 0, "fenced off"
    assert store.record([Outcome(ln, "done", response='{"ok": true}', tokens=1) for ln in second]) == 3
    assert store.record([Outcome(second[0], "done", response='{"twice": true}', tokens=1)]) == 0
    assert store.batch(bid)["status"] == "completed"
    assert [json.loads(r["response"]) for r in store.results(bid, "done")] == [{"ok": True}] * 3


def test_a_live_holder_keeps_its_lines_and_a_claim_passes_them_over(store):
    _batch(store, 4)
    held = store.claim(2, "node-a", lease_s=0.5)
    assert len(store.renew("node-a", 60)) == 2
    assert store.recover(everything=False) == 0, "a renewed lease is not taken"
    other = store.claim(10, "node-b")
    assert {ln.custom_id for ln in other} == {"c2", "c3"} and not {ln.custom_id for ln in held} & {"c2", "c3"}


def test_the_claim_order_on_either_engine(store):
    low = _batch(store, 4, owner="k1")
    high = _batch(store, 2, owner="k2", priority=5)
    other = _batch(store, 4, owner="k3")
    got = store.claim(6, "n")
    assert [ln.batch_id for ln in got[:2]] == [high, high]
    assert sorted(ln.batch_id for ln in got[2:]) == sorted([low, low, other, other])


class Killed(BaseException):
    """The creator's process ends here: nothing after it runs (its cleanup neither)."""


def test_a_creation_whose_creator_stopped_is_failed_once_its_lease_runs_out(store, monkeypatch):
    import timeslice_verl.batch.store as module

    def rows():
        yield from parse(b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}}', CHAT)
        raise Killed

    real, calls = store.transaction, []

    def transaction():
        calls.append(1)
        if len(calls) > 1:  # the batch inserted, then nothing more: its cleanup never runs
            raise Killed
        return real()

    monkeypatch.setattr(module, "CREATING_S", -1.0)  # the creation's lease has run out by the time anyone looks
    monkeypatch.setattr(store, "transaction", transaction)
    with pytest.raises(Killed):
        store.create_batch(CHAT, "f", 86400, "24h", None, rows())
    monkeypatch.setattr(store, "transaction", real)
    stuck = [b for b in store.batches() if b["status"] == "validating"]
    assert len(stuck) == 1
    store.recover(everything=False)
    assert store.batch(stuck[0]["id"])["status"] == "failed"
    assert json.loads(store.batch(stuck[0]["id"])["errors"])["data"][0]["code"] == "interrupted"


def test_a_dsn_never_comes_from_the_command_line_and_its_file_must_be_private(tmp_path, monkeypatch):
    from timeslice_verl.batch.engine import StoreError
    from timeslice_verl.batch.pg import DSN_ENV, read_dsn, shown

    monkeypatch.delenv(DSN_ENV, raising=False)
    with pytest.raises(StoreError, match="TIMESLICE_BATCH_DSN, or timeslice.batch.dsn_file"):
        read_dsn("")
    f = tmp_path / "dsn"
    f.write_text("postgresql://u:secret@db:5432/q\n")
    f.chmod(0o644)
    with pytest.raises(StoreError, match="dsn_file"):
        read_dsn(str(f))
    f.chmod(0o600)
    assert read_dsn(str(f)) == ("postgresql://u:secret@db:5432/q", str(f))
    assert "secret" not in shown("postgresql://u:secret@db:5432/q")
    monkeypatch.setenv(DSN_ENV, "host=/tmp dbname=x")
    assert read_dsn(str(f))[1] == DSN_ENV


def test_a_store_setting_that_holds_a_dsn_is_refused_naming_where_it_goes():
    from timeslice_verl.config.schema import ConfigError, load_settings

    with pytest.raises(ConfigError, match="timeslice.batch.store: .*TIMESLICE_BATCH_DSN"):
        load_settings({"batch": {"store": "postgresql://u:p@h/db"}})
    assert str(load_settings({"batch": {"store": "postgresql"}}).batch.store) == "postgresql"


def _status(http, bid: str) -> dict:
    """The batch, or nothing while the API cannot reach the database (503: the server restarting)."""
    resp = http.get(f"/v1/batches/{bid}")
    return resp.json() if resp.status_code == 200 else {}


def _answers(http, bid: str) -> list[str]:
    from batch_support import output_lines

    batch = http.get(f"/v1/batches/{bid}").json()
    return [line["custom_id"] for line in output_lines(http, batch)]


@pytest.mark.postgresql
def test_three_nodes_consume_one_batch_through_a_killed_feeder_a_killed_api_and_a_restarted_database(tmp_path, procs,
                                                                                                      server):
    """Every ``custom_id`` once, none lost: what a cluster queue owes its users first."""
    from agent_support import AgentProc, FakeVllmProc, eventually
    from batch_support import BatchServiceProc, write_requests

    env = {"TIMESLICE_BATCH_DSN": server.database(f"three_{os.getpid()}_{time.monotonic_ns()}"),
           "TIMESLICE_BATCH_API_KEY": "k" * 32}
    common = ("timeslice.batch.store=postgresql", "timeslice.batch.lease_s=3")
    nodes = []
    for i in range(3):
        tenant = FakeVllmProc("--max-num-seqs", "16", "--token-s", "0.002")
        procs.append(tenant)
        (tmp_path / f"node{i}").mkdir()
        agent = AgentProc(tmp_path / f"node{i}", tenant_url=tenant.url).start()
        procs.append(agent)
        feeder = BatchServiceProc(tmp_path / f"node{i}", tenant.url, agent_socket=agent.socket, command=("feed",),
                                  env=env, extra=(*common, "timeslice.batch.concurrency=16",
                                                  "timeslice.batch.adapt_concurrency=false")).start()
        procs.append(feeder)
        nodes.append((tenant, agent, feeder))
    apis = [BatchServiceProc(tmp_path / f"api{i}", "", command=("serve", "--api-only"), env=env, extra=common).start()
            for i in range(2)]
    procs.extend(apis)
    ids = write_requests(tmp_path / "in.jsonl", 20_000, max_tokens=lambda i: 2)
    with apis[0].http() as http:
        fid = http.post("/v1/files", files={"file": ("in.jsonl", (tmp_path / "in.jsonl").read_bytes())},
                        data={"purpose": "batch"}).json()["id"]
        bid = http.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h"}).json()["id"]
    with apis[1].http() as http:
        done = lambda: _status(http, bid).get("request_counts", {}).get("completed", 0)  # noqa: E731
        eventually(lambda: done() >= 2_000, what="the three nodes feeding", timeout=300)
        # node 0's feeder itself feeding (under load the other two may have done the first 2 000 alone): lines in
        # flight at its tenant, so that it holds claimed lines from here until the queue runs dry
        eventually(lambda: nodes[0][0].stats()["running"] > 0, what="node 0's feeder sending", timeout=300)
        nodes[0][2].kill()  # kill -9 a feeder with lines in flight: they come back after its lease
        apis[0].kill()  # an API replica: the other answers
        eventually(lambda: done() >= 6_000, what="two nodes feeding on", timeout=300)
        server.restart()  # the database itself (immediate stop: as a crash)
        batch = eventually(lambda: (b := _status(http, bid)).get("status") == "completed" and b,
                           what="the batch completed", timeout=600)
        answers = _answers(http, bid)
        figures = http.get(f"/timeslice/batches/{bid}").json()
    assert figures["retried"] > 0, "the killed feeder's lines were sent again once its lease ran out"
    assert batch["request_counts"] == {"total": 20_000, "completed": 20_000, "failed": 0}
    assert sorted(answers) == ids, "every custom_id answered once, none lost"
    served = [t.stats()["completed"] for t, _, _ in nodes]
    assert min(served[1:]) > 0 and sum(served) >= 20_000, served
