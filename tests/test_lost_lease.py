"""A feeder that was away past its lease (stopped: a GC pause, SIGSTOP) does not send the lines it had claimed and
not sent yet once another node took them over: before sending after a pause it renews, and drops what it no
longer holds (sent, they were answered twice, the second answer discarded)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pg_support import Postgres, need_postgres
from timeslice_verl.batch.lines import parse
from timeslice_verl.batch.store import Outcome, Store

CHAT = "/v1/completions"


@pytest.mark.postgresql
def test_a_feeder_back_from_a_pause_drops_the_lines_another_node_took_over(tmp_path, procs):
    from agent_support import FakeVllmProc, eventually
    from batch_support import BatchServiceProc
    from timeslice_verl.batch.pg import PostgresEngine

    need_postgres()
    pg = Postgres().start()
    try:
        dsn = pg.database("lease")
        store = Store(PostgresEngine(dsn))
        tenant = FakeVllmProc("--token-s", "0.05")  # 2 000 tokens: each send stays in flight for the whole test
        procs.append(tenant)
        feeder = BatchServiceProc(tmp_path, tenant.url, command=("feed",),
                                  env={"TIMESLICE_BATCH_DSN": dsn, "TIMESLICE_BATCH_API_KEY": "k" * 32},
                                  extra=("timeslice.batch.store=postgresql", "timeslice.batch.lease_s=3",
                                         "timeslice.batch.concurrency=2", "timeslice.batch.adapt_concurrency=false"))
        procs.append(feeder.start())
        text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                                     "body": {"model": "m", "prompt": f"c{i}", "max_tokens": 2000}}) for i in range(10))
        bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse(text.encode(), CHAT))
        held = lambda: store.batch(bid)["inflight"]  # noqa: E731
        eventually(lambda: feeder.get("/timeslice/summary")["feeder"]["sent"] == 2 and held() == 4,
                   what="two lines sent and two claimed ahead")
        os.kill(feeder.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            eventually(lambda: store.recover(everything=False), what="its leases run out")
            taken = store.claim(10, "node-b")
            assert len(taken) == 10, "every line queued again, the stopped feeder's too"
            assert store.record([Outcome(ln, "done", response="{}", tokens=1) for ln in taken]) == len(taken)
        finally:
            os.kill(feeder.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        eventually(lambda: feeder.get("/timeslice/summary")["feeder"].get("lost", 0) >= 2,
                   what="the lines claimed and not sent dropped")
        assert feeder.get("/timeslice/summary")["feeder"]["sent"] == 2, "none of the lines it lost was sent"
        store.close()
    finally:
        pg.close()
