"""The tenant's warm-up: a newly registered vLLM sleeps and wakes before any trainer needs the GPU.

The real :class:`Arbiter` in this process (CPU ``sigstop`` backend), a stand-in vLLM in its own process, and for the
agent as users start it, a real agent daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from agent_support import AgentProc, FakeVllmProc, eventually, spawn_worker
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.options import AgentOptions, TenantOptions
from timeslice_verl.agent.freeze import make_backend
from timeslice_verl.agent.state import StateStore
from timeslice_verl.agent.tenant.tenancy import FIRST_SLEEP
from timeslice_verl.agent.tenant.warmup import WARM_UP_CYCLES, until_asked
from timeslice_verl.demo.procs import wait_tenant_warm


def arbiter(tmp_path, **tenant) -> Arbiter:
    return Arbiter(make_backend("sigstop", probe=None, driver_timeout_s=5), StateStore(tmp_path / "state.json"),
                   agent=AgentOptions(watch_interval_s=3600), tenant=TenantOptions(**tenant))


def moves(a: Arbiter) -> list[tuple[str, bool, str]]:
    return [(t.action, t.ok, t.detail) for _, t in a.journal.moves if t.action.startswith("tenant_")]


def hold_first_yield(a: Arbiter, before: Callable[[], Awaitable[None]]) -> None:
    """The registered tenant's first yield awaits ``before`` first (a slow or a stuck sleep); every later one runs."""
    real, calls = a.tenancy.tenant.yield_gpu, []

    async def first_held(sleep: bool = True):
        calls.append(sleep)
        if len(calls) == 1:
            await before()
        return await real(sleep)

    a.tenancy.tenant.yield_gpu = first_held


async def mid_first_sleep(a: Arbiter, vllm: FakeVllmProc) -> asyncio.Event:
    """Register ``vllm`` with the started ``a``, hold its first sleep (the warm-up's) under way and connect a trainer;
    the first sleep ends once the returned event is set (never, if it is not)."""
    started, go = asyncio.Event(), asyncio.Event()
    await a.register_tenant([vllm.url])

    async def until_go():
        started.set()
        await go.wait()

    hold_first_yield(a, until_go)
    await started.wait()
    a.connection_opened(1, None)
    return go


def test_a_registered_tenant_is_warmed_up_and_its_first_sleep_is_never_the_yield_the_trainer_plans_with(tmp_path):
    vllm = FakeVllmProc()

    async def scenario():
        a = arbiter(tmp_path)
        await a.start()
        await a.register_tenant([vllm.url])
        await a.settled(60)
        seen, tenant = moves(a), a.tenancy.describe()
        yields = [t for _, t in a.journal.moves if t.action == "tenant_yield"]
        await a.shutdown()
        return seen, tenant, yields

    try:
        seen, tenant, yields = asyncio.run(scenario())
        assert [(m[0], m[1]) for m in seen] == [("tenant_yield", True), ("tenant_reclaim", True)] * WARM_UP_CYCLES
        assert seen[0][2].endswith(f"({FIRST_SLEEP})") and FIRST_SLEEP not in seen[2][2]
        assert tenant["state"] == "awake" and not vllm.sleeping(), "the warm-up leaves the tenant serving"
        assert tenant["yield_s"] == round(yields[-1].seconds, 3), "the trainer's estimate starts from a steady yield"
    finally:
        vllm.stop()


def test_a_trainer_that_asks_during_the_warm_up_gets_the_gpu_with_the_tenant_asleep(tmp_path):
    vllm = FakeVllmProc()
    worker = spawn_worker("warm-job")

    async def scenario():
        a = arbiter(tmp_path)
        await a.start()
        go = await mid_first_sleep(a, vllm)  # the first sleep is held until the trainer has asked
        acquire = asyncio.ensure_future(a.acquire("warm-job", 1))
        await asyncio.sleep(0)  # let the acquire queue (no timing: it runs up to its wait at once)
        assert list(a.book.queue) == ["warm-job"]
        go.set()
        reply = await asyncio.wait_for(acquire, 60)
        seen = moves(a)
        holding = a.book.jobs["warm-job"].holding
        await a.release("warm-job", 1, done=True)
        await a.settled(60)
        await a.shutdown()
        return reply, seen, holding

    try:
        reply, seen, holding = asyncio.run(scenario())
        assert holding and reply["job"] == "warm-job"
        assert [(m[0], m[1]) for m in seen][:1] == [("tenant_yield", True)]
        assert ("tenant_reclaim", True) not in [(m[0], m[1]) for m in seen[:2]], \
            "the warm-up stops at the sleep the trainer needs: no wake-up under it"
    finally:
        worker.kill()
        vllm.stop()


def test_a_first_sleep_slower_than_the_reclaim_deadline_still_warms_the_tenant_when_no_trainer_asks(tmp_path):
    vllm = FakeVllmProc()

    async def scenario():
        a = arbiter(tmp_path, reclaim_deadline_s=0.05)
        await a.start()
        await a.register_tenant([vllm.url])
        # pinning a 7 B model's host buffers, many times the deadline: a floor on the sleep's length, not a
        # synchronisation (nothing waits on it)
        hold_first_yield(a, lambda: asyncio.sleep(0.5))
        await a.settled(60)
        seen = moves(a)
        await a.shutdown()
        return seen

    try:
        seen = asyncio.run(scenario())
        assert [(m[0], m[1]) for m in seen] == [("tenant_yield", True), ("tenant_reclaim", True)] * WARM_UP_CYCLES, seen
        assert seen[0][2].endswith(f"({FIRST_SLEEP})"), "the slow one-off is the first sleep, never the planned yield"
        assert not vllm.sleeping()
    finally:
        vllm.stop()


def test_a_trainer_that_asks_during_a_sleep_that_never_ends_gets_the_gpu_down_the_usual_ladder(tmp_path):
    vllm = FakeVllmProc()
    worker = spawn_worker("stuck-job")

    async def scenario():
        a = arbiter(tmp_path, reclaim_deadline_s=5.0)  # the usual yield after it, on a loaded host too
        await a.start()
        await mid_first_sleep(a, vllm)  # a sleep that never ends
        reply = await asyncio.wait_for(a.acquire("stuck-job", 1), 60)
        seen, holding = moves(a), a.book.jobs["stuck-job"].holding
        await a.release("stuck-job", 1, done=True)
        await a.settled(60)
        await a.shutdown()
        return reply, seen, holding

    try:
        reply, seen, holding = asyncio.run(scenario())
        assert holding and reply["job"] == "stuck-job"
        assert seen[0][:2] == ("tenant_yield", False) and "'stuck-job' asking" in seen[0][2], seen
        assert ("tenant_yield", True) in [(m[0], m[1]) for m in seen[1:]], "then the usual yield gave the GPU back"
    finally:
        worker.kill()
        vllm.stop()


ASKED_AT = 3


@pytest.mark.parametrize("finish, deadline_s, outcome", [
    ("before", 0.05, "done"),    # finished before anyone asked
    ("never", 0.05, "timeout"),  # asked, never finished: cancelled once the deadline has passed since the ask
    ("after", 0.0, "done"),      # asked, no deadline: waited for, however long
])
def test_until_asked_bounds_the_work_only_from_the_ask(finish, deadline_s, outcome):
    async def scenario():
        loop = asyncio.get_running_loop()
        work: asyncio.Future[float] = loop.create_future()
        polls = []

        def asked():
            polls.append(1)
            if finish == "before" and not work.done():
                work.set_result(1.5)
            if len(polls) < ASKED_AT:
                return None
            if finish == "after":
                loop.call_later(0.3, work.set_result, 1.5)  # later than a few polls; asked() is not called again
            return "job"

        try:
            return await until_asked(work, asked, deadline_s), work
        except asyncio.TimeoutError:
            return "timeout", work

    result, work = asyncio.run(scenario())
    if outcome == "done":
        assert result == 1.5
    else:
        assert result == "timeout" and work.cancelled()


def test_no_warm_up_when_it_is_turned_off(tmp_path):
    vllm = FakeVllmProc()

    async def scenario():
        a = arbiter(tmp_path, warm_up=False)
        await a.start()
        await a.register_tenant([vllm.url])
        await a.settled(60)
        seen = moves(a)
        await a.shutdown()
        return seen

    try:
        assert asyncio.run(scenario()) == []
    finally:
        vllm.stop()


def test_the_agent_daemon_warms_up_its_configured_tenant_and_says_so(tmp_path):
    vllm = FakeVllmProc()
    agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=("timeslice.tenant.warm_up=true",)).start()
    try:
        wait_tenant_warm(agent.socket)  # what the demo waits for before it starts its trainer
        assert agent.status()["tenant"]["warming"] is False
        eventually(lambda: "warm-up 2/2" in agent.log(), what="the warm-up's second cycle in the agent's log")
        tenant = eventually(lambda: (t := agent.status()["tenant"]) and t["state"] == "awake" and t["yield_s"] is not None and t,
                            what="the tenant awake again with a yield measured")
        assert FIRST_SLEEP in agent.log() and not vllm.sleeping()
        assert tenant["footprint"] == 0, "no NVML here: the footprint stays unknown, never guessed"
    finally:
        agent.stop()
        vllm.stop()
