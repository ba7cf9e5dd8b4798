"""The batch service at a dedicated GPU's pace: a store whose counters never drift and whose grouped
writes keep every line exactly once through a ``kill -9`` between an answer and its commit; the stand-in's capacity
bounded as a GPU's is. The in-flight limit's policy: ``test_concurrency.py``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest

from timeslice_verl.batch.lines import parse
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
        lines = store.claim(rng.randint(0, 20))
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
    lines = store.claim(40)
    store.record([Outcome(ln, "done", response='{"first": true}', tokens=1) for ln in lines[:20]])  # committed
    import timeslice_verl.batch.claims as claims
    claims.settle = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # dies inside the next grouped write
    store.record([Outcome(ln, "done", response='{"lost": true}', tokens=1) for ln in lines[20:]])
""")


def test_a_kill_between_the_answers_and_their_grouped_commit_sends_those_lines_again_and_records_each_once(tmp_path):
    db = tmp_path / "b.sqlite"
    store = Store(db)
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(40), CHAT))
    store.close()
    child = subprocess.run([sys.executable, "-c", _KILLED_MID_COMMIT, str(db)], check=False, capture_output=True,
                           text=True)
    assert child.returncode == -9, child.stderr

    store = Store(db)
    assert store.counts(bid) == {"queued": 0, "inflight": 20, "completed": 20, "failed": 0}
    assert store.recover() == 20
    again = store.claim(100)
    assert sorted(ln.custom_id for ln in again) == sorted(f"c{i}" for i in range(20, 40))
    assert all(ln.attempts == 2 for ln in again)
    store.record([Outcome(ln, "done", response='{"second": true}', tokens=1) for ln in again])
    rows = list(store.results(bid, "done"))
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(40))
    assert not any("lost" in r["response"] for r in rows)
    assert store.batch(bid)["status"] == "completed" and store.figures(bid)["retried"] == 20


def test_lines_go_out_oldest_batch_first_in_input_order_also_within_one_second(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    first = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(3), CHAT))
    second = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(3), CHAT))
    got = store.claim(5)
    assert [(ln.batch_id, ln.idx) for ln in got] == [(first, 0), (first, 1), (first, 2), (second, 0), (second, 1)]
    assert [b["id"] for b in store.batches()] == [second, first]
    assert [b["id"] for b in store.batches(after=second)] == [first]


def test_lines_claimed_ahead_and_never_sent_go_back_without_counting_a_try(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(10), CHAT))
    ahead = store.claim(6)
    assert store.release(ahead[2:]) == 4 and store.counts(bid) == {"queued": 8, "inflight": 2, "completed": 0, "failed": 0}
    again = store.claim(10)
    assert [ln.idx for ln in again] == [2, 3, 4, 5, 6, 7, 8, 9] and all(ln.attempts == 1 for ln in again)
    store.cancel(bid)
    assert store.release(again) == 8  # a cancel while they were held: never sent, they are no failures
    assert store.counts(bid) == {"queued": 0, "inflight": 2, "completed": 0, "failed": 0}
    assert len(list(store.results(bid, "failed"))) == 8, "each in the error file, as batch_cancelled"
    assert store.figures(bid)["retried"] == 0


def test_one_batch_feeds_every_tenant_of_the_node_each_line_answered_once(tmp_path, procs):
    """The service follows the node's tenant list (``tenant.urls``): one queue, a feeder per
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
