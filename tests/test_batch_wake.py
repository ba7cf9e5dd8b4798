"""An idle feeder is woken by the database when lines become claimable: on PostgreSQL a new batch created through
another node's store reaches a feeder that waits out a look far longer than the test (its look for lines untold is
the fallback). On SQLite the service kicks its own feeders: the engine says it cannot tell."""

from __future__ import annotations

import asyncio
import json

import pytest

from pg_support import fresh_database, server  # noqa: F401 (server: a fixture)
from timeslice_verl.batch import idle
from timeslice_verl.batch.concurrency import Policy
from timeslice_verl.batch.lines import parse
from timeslice_verl.batch.store import Store

CHAT = "/v1/completions"


def _file(n: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
                     for i in range(n)).encode()


def test_sqlite_cannot_tell_and_its_feeders_look_at_the_short_interval(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    assert store.listen(lambda: None) is None
    assert idle.Waker(asyncio.Event()).poll_s == idle.POLL_S
    store.close()


@pytest.mark.postgresql
def test_an_idle_feeder_claims_a_batch_created_on_another_node_when_notified(server, procs, monkeypatch):
    from agent_support import FakeVllmProc, eventually

    from timeslice_verl.batch.feeder import Feeder
    from timeslice_verl.batch.gate import Gate
    from timeslice_verl.batch.pg import PostgresEngine

    monkeypatch.setattr(idle, "NOTIFIED_POLL_S", 3600.0)  # its own look would come long after the test's end
    tenant = FakeVllmProc()
    procs.append(tenant)
    dsn = fresh_database(server, "wake")
    feeding, api = Store(PostgresEngine(dsn)), Store(PostgresEngine(dsn))
    claims: list[tuple[int, int]] = []
    """Each claim of the feeder: how often it had been woken when the claim began, and the lines it took."""

    async def run() -> tuple[int, int]:
        feeder = Feeder(feeding, tenant.url, Gate(None, poll_s=0.05), policy=Policy(start=4), adapt=False,
                        settle=False)
        real = feeding.claim

        def claim(*args, **kwargs):
            woken = feeder.waker.woken
            got = real(*args, **kwargs)
            claims.append((woken, len(got)))
            return got

        monkeypatch.setattr(feeding, "claim", claim)
        task = asyncio.create_task(feeder.run())

        async def until(check, what):
            return await asyncio.to_thread(eventually, check, what=what)

        # idle: woken once listening (what was sent before), then a claim since then found nothing
        await until(lambda: feeder.waker.poll_s == 3600.0 and any(w >= 1 and n == 0 for w, n in claims)
                    and not feeder._claiming, "the feeder listening and idle")
        woken = feeder.waker.woken
        bid = await asyncio.to_thread(api.create_batch, CHAT, "f", 86400, "24h", None, parse(_file(3), CHAT))
        await until(lambda: api.counts(bid)["completed"] == 3, "the new batch's lines answered")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return woken, feeder.waker.woken

    before, after = asyncio.run(run())
    assert after > before, "the feeder was woken by the database"
    assert [n for w, n in claims if w > before and n], "a claim made once woken took the lines"
    feeding.close()
    api.close()
