"""A falling in-flight limit takes effect at once: the newest sends past it are cancelled, their lines
queued again with the try not counted — also sends cancelled before they ever ran."""

from __future__ import annotations

import json

from timeslice_verl.batch.concurrency import Policy
from timeslice_verl.batch.lines import parse
from timeslice_verl.batch.store import Store

CHAT = "/v1/chat/completions"


def _file(n: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                                 "body": {"model": "m", "messages": []}}) for i in range(n)).encode()


def test_a_falling_limit_cancels_the_newest_sends_and_their_lines_go_again_untried(tmp_path, procs):
    """A limit that falls takes effect at once: the newest sends past it are cancelled (the stand-in, like vLLM,
    stops a request whose client went away) and their lines queue again, the try not counted; every line is then
    answered once. The stand-in is paused throughout the shedding, so nothing finishes on its own meanwhile."""
    import asyncio

    from agent_support import FakeVllmProc, eventually

    from timeslice_verl.batch.feeder import Feeder
    from timeslice_verl.batch.gate import Gate

    tenant = FakeVllmProc("--token-s", "0.001")
    procs.append(tenant)
    tenant.post("/pause?mode=keep")
    store = Store(tmp_path / "b.sqlite")
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(10), CHAT))

    async def run() -> tuple[int, dict]:
        feeder = Feeder(store, tenant.url, Gate(None, poll_s=0.05), policy=Policy(start=8), adapt=False)
        task = asyncio.create_task(feeder.run())

        async def until(check, what):
            return await asyncio.to_thread(eventually, check, what=what)

        await until(lambda: tenant.stats()["waiting"] == 8, "8 requests held by the paused stand-in")
        feeder.stats.limit = 3
        shed = feeder.shed()
        await until(lambda: tenant.stats()["cancelled"] == 5, "5 requests cancelled at the stand-in")
        await until(lambda: feeder.stats.inflight == 3 and not feeder._shed_lines, "the shed lines queued again")
        assert tenant.stats()["waiting"] == 3
        tenant.post("/resume")
        await until(lambda: store.counts(bid)["completed"] == 10, "every line answered")
        task.cancel()
        return shed, feeder.stats

    shed, stats = asyncio.run(run())
    assert shed == 5 and stats.shed == 5 and stats.answered == 10
    assert store.figures(bid)["retried"] == 0, "a shed try is not counted"
    assert tenant.stats()["completed"] == 10 and tenant.stats()["cancelled"] == 5
    tries = store.query("SELECT attempts FROM lines WHERE batch_id = ?", (bid,))
    assert [r["attempts"] for r in tries] == [1] * 10


def test_sends_shed_before_they_ever_ran_free_their_slots_and_lines(tmp_path, procs):
    """The newest sends are the ones just launched: cancelled in the loop step that made them, their coroutines
    never run (a ``finally`` inside them would never free the slot: in a dry run five slots stayed taken and the
    batch never ended). Their slots and lines are freed all the same."""
    import asyncio

    import aiohttp
    from agent_support import FakeVllmProc

    from timeslice_verl.batch.feeder import Feeder
    from timeslice_verl.batch.gate import Gate

    tenant = FakeVllmProc()
    procs.append(tenant)
    tenant.post("/pause?mode=keep")
    store = Store(tmp_path / "b.sqlite")
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse(_file(4), CHAT))

    async def run() -> tuple[int, int]:
        feeder = Feeder(store, tenant.url, Gate(None), policy=Policy(start=4), adapt=False)
        async with aiohttp.ClientSession(tenant.url) as session:
            for line in store.claim(4):
                feeder._launch(session, line)
            feeder.stats.limit = 1
            shed = feeder.shed()
            for _ in range(6000):  # a guard against a hang, no measurement
                if not feeder._shed_lines and store.counts(bid)["queued"] == 3:
                    break
                await asyncio.sleep(0.01)
            return shed, feeder.stats.inflight

    assert asyncio.run(run()) == (3, 1)
    assert store.counts(bid) == {"queued": 3, "inflight": 1, "completed": 0, "failed": 0}
    assert [ln.attempts for ln in store.claim(3)] == [1, 1, 1], "the shed tries are not counted"
