"""The vLLM tenant contract, against the stand-in server (its failure modes included)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent_support import AgentProc, FakeVllmProc, eventually, spawn_worker
from timeslice_verl.agent.client import AgentError
from timeslice_verl.agent.tenant.vllm import ASLEEP, AWAKE, TenantDead, TenantError, VllmTenant
from timeslice_verl.agent.tenant.group import TenantGroup
from timeslice_verl.standin.server import StandinServer


@pytest.fixture
def server():
    s = StandinServer(sleep_in_flight="abort", token_s=0.01).start()
    yield s
    s.stop()


def run(coro):
    return asyncio.run(coro)


async def _with_tenant(url, fn, pause_mode="keep"):
    tenant = VllmTenant(url, drain_timeout_s=10, pause_mode=pause_mode)
    try:
        return await fn(tenant)
    finally:
        await tenant.close()


def test_register_yield_reclaim_round_trip(server):
    async def scenario(t: VllmTenant):
        info = await t.register()
        assert (info.version, info.pause, t.state) == ("0.24.0", "wait", AWAKE)
        await t.yield_gpu()
        assert t.state == ASLEEP and server.engine.sleeping and server.engine.paused
        await t.yield_gpu()  # idempotent
        await t.reclaim()
        assert t.state == AWAKE and not server.engine.sleeping and not server.engine.paused

    run(_with_tenant(server.url, scenario))


def test_a_hold_is_one_request_and_its_reclaim_wakes_a_server_put_to_sleep_meanwhile(server):
    """The trainer waits for a pause-only yield: it sends ``/pause`` alone (nothing read back); the reclaim, off the
    trainer's path, finds a server that something put to sleep meanwhile and wakes it before resuming."""
    async def scenario(t: VllmTenant):
        await t.register()
        before = dict(server.engine.stats()["control_calls"])
        await t.yield_gpu(sleep=False)
        after = server.engine.stats()["control_calls"]
        assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {"/pause": 1}
        assert t.held and server.engine.paused and not server.engine.sleeping
        server.engine.sleep("keep")  # someone else's /sleep while held
        await t.reclaim()
        assert t.state == AWAKE and not server.engine.sleeping and not server.engine.paused

    run(_with_tenant(server.url, scenario))


def test_yield_waits_for_in_flight_requests_instead_of_aborting_them(server):
    results = []
    t = threading.Thread(target=lambda: results.append(server.engine.generate(50)))
    t.start()
    eventually(lambda: server.engine.stats()["running"] == 1)

    async def scenario(tenant: VllmTenant):
        await tenant.register()
        await tenant.yield_gpu()
        return server.engine.stats()["completed"]

    completed_when_asleep = run(_with_tenant(server.url, scenario, pause_mode="wait"))
    t.join(60)
    assert completed_when_asleep == 1, "the yield waited for the request in flight to finish"
    assert results == [(50, "length")] and server.engine.aborted == 0


def test_old_vllm_without_pause_is_drained_through_metrics():
    old = StandinServer(version="0.13.0", sleep_in_flight="abort", token_s=0.01).start()
    try:
        results = []
        t = threading.Thread(target=lambda: results.append(old.engine.generate(40)))
        t.start()
        eventually(lambda: old.engine.stats()["running"] == 1)

        async def scenario(tenant: VllmTenant):
            info = await tenant.register()
            assert info.pause == "drain"
            await tenant.yield_gpu()
            assert tenant.state == ASLEEP
            await tenant.reclaim()

        run(_with_tenant(old.url, scenario))
        t.join(5)
        assert results == [(40, "length")] and old.engine.aborted == 0
    finally:
        old.stop()


def test_dev_mode_off_is_a_clear_error():
    plain = StandinServer(dev_mode=False).start()
    try:
        with pytest.raises(TenantError, match="VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode"):
            run(_with_tenant(plain.url, lambda t: t.register()))
    finally:
        plain.stop()


def test_unreachable_server_is_dead():
    with pytest.raises(TenantDead, match="does not answer"):
        run(_with_tenant("http://127.0.0.1:9", lambda t: t.register()))


@pytest.mark.parametrize(
    ("members", "outcome", "left_out"),
    [
        (["ok", "ok"], None, 0),                  # both move
        (["ok", "dead"], None, 1),                # the live one moves, the dead one is left out and named
        (["dead", "dead"], TenantDead, 2),        # none answers: the group is dead
        (["ok", "no-dev-mode"], TenantError, 0),  # a server that answers wrongly fails the move (faulted)
        (["no-dev-mode", "dead"], TenantError, 1),
    ],
)
def test_a_group_moves_the_servers_that_answer(members, outcome, left_out):
    servers = {"ok": lambda: StandinServer().start(), "no-dev-mode": lambda: StandinServer(dev_mode=False).start()}
    started = [servers[m]() if m in servers else None for m in members]
    dead_urls = ["http://127.0.0.1:9", "http://127.0.0.1:1"]
    urls = [srv.url if srv else dead_urls.pop() for srv in started]

    async def scenario():
        group = TenantGroup(urls, request_timeout_s=5)
        try:
            if outcome is not None:
                with pytest.raises(outcome):
                    await group.register()
                return group.dead
            await group.register()
            await group.yield_gpu()
            assert group.state == ASLEEP and all(srv.engine.sleeping for srv in started if srv)
            await group.reclaim()
            assert group.state == AWAKE and not any(srv.engine.sleeping for srv in started if srv)
            assert group.note == ("not answering, left out: http://127.0.0.1:1" if left_out else "")
            return group.dead
        finally:
            await group.close()

    try:
        assert len(run(scenario())) == left_out
    finally:
        for srv in started:
            if srv:
                srv.stop()


def test_agent_with_an_old_crash_prone_vllm_never_crashes_it(tmp_path):
    vllm = FakeVllmProc("--version", "0.13.0", "--sleep-in-flight", "crash")
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    w = spawn_worker("job-a")
    try:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", vllm.complete(60)))
        t.start()
        eventually(lambda: vllm.stats()["running"] == 1)
        with agent.client() as c:
            c.acquire("job-a")
            assert vllm.alive() and vllm.sleeping()
            t.join(10)
            assert out["r"]["choices"][0]["finish_reason"] == "length"
            c.release("job-a", wait=True)
        assert not vllm.sleeping()
    finally:
        w.kill()
        agent.stop()
        vllm.stop()


def test_agent_refuses_a_tenant_without_dev_mode(tmp_path):
    plain = FakeVllmProc("--no-dev-mode")
    agent = AgentProc(tmp_path).start()
    try:
        with agent.client() as c:
            with pytest.raises(AgentError) as err:
                c.register_tenant([plain.url])
            assert err.value.code == "tenant" and "VLLM_SERVER_DEV_MODE=1" in err.value.message
            assert c.status()["tenant"] is None
            good = FakeVllmProc()
            try:
                assert c.register_tenant([good.url])["state"] == "awake"
                with pytest.raises(AgentError, match="already registered"):
                    c.register_tenant([plain.url])
                w = spawn_worker("job-a")
                c.acquire("job-a")
                assert good.sleeping()
                # unregistering a sleeping tenant wakes it first
                assert c.unregister_tenant()["unregistered"]
                assert not good.sleeping()
                c.release("job-a")
                w.kill()
            finally:
                good.stop()
    finally:
        agent.stop()
        plain.stop()


def test_requests_queued_during_the_pause_survive_the_sleep(server):
    """/sleep pauses again with its own mode (abort by default): the tenant must ask for keep."""
    results = []
    first = threading.Thread(target=lambda: results.append(("first", server.engine.generate(40))))
    first.start()
    eventually(lambda: server.engine.stats()["running"] == 1)

    async def scenario(tenant: VllmTenant):
        await tenant.register()
        task = asyncio.create_task(tenant.yield_gpu())  # pause(mode=wait) waits for `first`
        await asyncio.sleep(0.1)
        second = threading.Thread(target=lambda: results.append(("second", server.engine.generate(5))))
        second.start()  # arrives while paused: queued
        await task
        assert server.engine.stats()["waiting"] == 1, "queued across the sleep"
        await tenant.reclaim()
        second.join(5)

    run(_with_tenant(server.url, scenario))
    first.join(5)
    assert sorted(results) == [("first", (40, "length")), ("second", (5, "length"))]
    assert server.engine.aborted == 0


def test_keep_mode_hands_over_without_waiting_for_long_generations():
    srv = StandinServer(token_s=0.01).start()
    try:
        results = []
        t = threading.Thread(target=lambda: results.append(srv.engine.generate(100)))  # ~1 s
        t.start()
        eventually(lambda: srv.engine.stats()["running"] == 1)

        async def scenario():
            tenant = VllmTenant(srv.url, pause_mode="keep")
            try:
                await tenant.register()
                await tenant.yield_gpu()
                frozen = {**srv.engine.stats(), "finished": len(results)}
                await tenant.reclaim()
                return frozen
            finally:
                await tenant.close()

        frozen = run(scenario())
        t.join(60)
        assert frozen["completed"] == 0 and frozen["finished"] == 0, "keep does not wait for the in-flight request"
        assert results == [(100, "length")], "the frozen request resumed and finished after wake-up"
    finally:
        srv.stop()
