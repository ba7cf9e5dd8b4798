"""A yield that costs only a pause when memory allows: the pure decision, the policy's moves, and
the real agent with the stand-in vLLM — held requests keep their place, and the tenant sleeps the moment the
trainer's peak grows into the margin."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import urllib.request

import pytest

from agent_support import FakeVllmProc, eventually, spawn_worker
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.options import AgentOptions, TenantOptions
from timeslice_verl.agent.freeze import make_backend
from timeslice_verl.agent.gpu import GpuMemory
from timeslice_verl.agent.tenant.hold import HoldPolicy, decide, tight
from timeslice_verl.agent.policy import ASLEEP, FROZEN, RUNNING, JobView, Move, MoveKind, World, next_move
from timeslice_verl.agent.state import StateStore
from timeslice_verl.names import YieldBy
from timeslice_verl.tools.status import render_status

GIB = 2**30
AUTO = HoldPolicy(YieldBy.auto, 4 * GIB)


@pytest.mark.parametrize("policy, free, now, peak, pause_only, why", [
    (AUTO, 30 * GIB, 20 * GIB, 20 * GIB, True, "fits"),                 # resident: the trainer's memory stays
    (AUTO, 30 * GIB, 20 * GIB, 0, False, "not measured yet"),           # its first hold: sleep
    (AUTO, None, 20 * GIB, 20 * GIB, False, "no NVML"),
    (AUTO, 30 * GIB, 20 * GIB, 48 * GIB, False, "does not fit"),        # coming back it needs 28 of 30, margin 12
    (AUTO, 30 * GIB, 0, 20 * GIB, True, "fits"),                        # parked 20: needs 20, 10 left ≥ 5
    (AUTO, 24 * GIB, 0, 20 * GIB, False, "does not fit"),               # 4 left < max(4, 5)
    (AUTO, 9 * GIB, 5 * GIB, 5 * GIB, True, "fits"),                    # the margin's floor: 4 GiB
    (HoldPolicy(YieldBy.sleep, 0), 100 * GIB, 1, 1, False, "yield_by=sleep"),
])
def test_a_pause_alone_only_where_the_measured_peak_fits_with_the_margin(policy, free, now, peak, pause_only, why):
    fit = decide(policy, free=free, job_now=now, job_peak=peak)
    assert fit.pause_only is pause_only and why in fit.why


@pytest.mark.parametrize("free, peak, must_sleep", [
    (10 * GIB, 20 * GIB, False), (2 * GIB, 20 * GIB, True),  # margin 5: sleep under 2.5
    (5 * GIB, 48 * GIB, True), (7 * GIB, 48 * GIB, False),  # margin 12: sleep under 6
])
def test_a_held_tenant_must_sleep_once_the_trainer_eats_half_the_margin(free, peak, must_sleep):
    assert tight(AUTO, free=free, job_peak=peak) is must_sleep


HOLDER = JobView("j", RUNNING, holding=True)
PARKED = JobView("j", FROZEN, queued=True, needs_room=True)


@pytest.mark.parametrize("world, move", [
    (World(jobs=(HOLDER,), tenant=ASLEEP, tenant_held=True), None),                          # held beside the trainer
    (World(jobs=(HOLDER,), tenant=ASLEEP, tenant_held=True, tenant_tight=True), Move(MoveKind.tenant_sleep)),
    (World(jobs=(PARKED,), queue_head="j", tenant=ASLEEP, tenant_held=True), Move(MoveKind.tenant_sleep)),  # unpark needs it
    (World(jobs=(PARKED,), queue_head="j", tenant=ASLEEP), Move(MoveKind.thaw, "j", waiting=True)),
    (World(jobs=(JobView("j", FROZEN),), tenant=ASLEEP, tenant_held=True), Move(MoveKind.tenant_reclaim)),  # a valley
])
def test_the_policy_sleeps_a_held_tenant_only_when_memory_is_needed(world, move):
    assert next_move(world) == move


class ScriptedGpu:
    """NVML as the agent reads it: the job's processes use ``job_bytes``; the stand-in vLLM holds ``TENANT`` bytes
    unless it is asleep (asked of the stand-in itself)."""

    TOTAL, TENANT = 80 * GIB, 30 * GIB
    driver_version, indices = "test", [0]

    def __init__(self, vllm: FakeVllmProc, pid: int) -> None:
        self.vllm, self.pid, self.job_bytes = vllm, pid, 20 * GIB

    def process_memory(self) -> dict[int, int]:
        return {self.pid: self.job_bytes}

    def memory(self) -> GpuMemory:
        used = self.job_bytes + (0 if self.vllm.sleeping() else self.TENANT)
        return GpuMemory(total=self.TOTAL, used=used, free=self.TOTAL - used)

    def uuids(self) -> list[str]:
        return ["GPU-test"]

    def gpus_of(self, pids: list[int]) -> list[int]:
        return [0]

    def largest_gpu(self) -> int:
        return self.TOTAL


def _ask(url: str) -> None:
    """A request that outlives the test (the stand-in makes 100 000 tokens at 10 ms each); it is never answered."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": "hi", "max_tokens": 100_000}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=3600).read()
    except Exception:  # the stand-in is stopped at the end of the test
        pass


def test_a_pause_only_yield_keeps_held_requests_and_sleeps_when_the_trainers_peak_grows(tmp_path):
    vllm, worker = FakeVllmProc(), spawn_worker("hold-job")
    gpu = ScriptedGpu(vllm, worker.pid)
    threading.Thread(target=_ask, args=(vllm.url,), daemon=True).start()
    eventually(lambda: vllm.stats()["running"] == 1, what="the request runs")

    async def scenario() -> list[dict]:
        a = Arbiter(make_backend("sigstop", probe=None, driver_timeout_s=5), StateStore(tmp_path / "state.json"),
                    probe=gpu, agent=AgentOptions(watch_interval_s=3600), tenant=TenantOptions(warm_up=False, hold=AUTO))
        await a.start()
        await a.register_tenant([vllm.url])
        a.connection_opened(1, None)
        a.register_pids("hold-job", [worker.pid], 1, None)
        seen = []

        async def valley() -> None:
            await a.release("hold-job", 1, wait=True)
            seen.append({"valley": vllm.stats(), "tenant": a.tenancy.state})

        await a.acquire("hold-job", 1)  # 1: no peak measured yet: pause and sleep
        seen.append({"hold": vllm.stats(), "held": a.tenancy.held})
        await a.watchdog.watch_once()  # the trainer computes with 20 GiB: its peak
        await valley()
        await a.acquire("hold-job", 1)  # 2: 20 GiB peak, 30 GiB free beside the tenant awake: a pause alone
        seen.append({"hold": vllm.stats(), "held": a.tenancy.held, "why": a.peaks.last_fit.why,
                     "status": render_status(a.snapshot())})
        await valley()  # a resume alone
        await a.acquire("hold-job", 1)  # 3: a pause alone again
        gpu.job_bytes = 48 * GIB  # a longer batch: the trainer's peak grows, 2 GiB left
        await a.watchdog.watch_once()
        await a.settled(60)
        seen.append({"grown": vllm.stats(), "held": a.tenancy.held})
        await valley()
        gpu.job_bytes = 20 * GIB
        await a.acquire("hold-job", 1)  # 4: its peak is 48 GiB now: coming back it needs 28 of 30 GiB: sleep
        seen.append({"hold": vllm.stats(), "held": a.tenancy.held, "why": a.peaks.last_fit.why})
        await valley()
        seen.append({"moves": [(t.action, t.detail) for _, t in a.journal.moves if t.action.startswith("tenant_")]})
        await a.shutdown()
        return seen

    try:
        first, valley1, second, valley2, grown, valley3, third, valley4, moves = asyncio.run(scenario())
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        vllm.stop()
    assert first["hold"]["sleeps"] == 1 and not first["held"]
    assert second["hold"]["sleeps"] == 1 and second["hold"]["paused"] and not second["hold"]["sleeping"], second
    assert second["held"] and second["hold"]["pauses"] == {"keep": 2} and "fits" in second["why"]
    assert "yields by (auto): held awake (paused) — fits: trainer peak 20.00 GiB" in second["status"], second["status"]
    assert valley2["valley"]["sleeps"] == 1 and valley2["valley"]["wake_up_calls"] == 1, "a resume alone, no wake-up"
    assert grown["grown"]["sleeps"] == 2 and grown["grown"]["sleeping"] and not grown["held"], grown
    assert third["hold"]["sleeps"] == 3 and not third["held"] and "does not fit" in third["why"]
    for v in (valley1, valley2, valley3, valley4):
        assert v["tenant"] == "awake" and not v["valley"]["paused"] and not v["valley"]["sleeping"]
    # the one request was held through every yield and runs again in every valley: never aborted, never lost, its
    # KV cache never dropped (vLLM's /pause clears caches unless told not to)
    assert all(s[k]["aborted"] == 0 and s[k]["running"] == 1 and s[k]["kv_dropped"] == 0 for s in (first, second, grown, third, valley1, valley2, valley3, valley4)
               for k in s if isinstance(s[k], dict))
    kinds = [m[0] for m in moves["moves"]]
    assert kinds == ["tenant_yield", "tenant_reclaim"] * 2 + ["tenant_yield", "tenant_sleep", "tenant_reclaim",
                                                               "tenant_yield", "tenant_reclaim"], moves
    details = [m[1] for m in moves["moves"]]
    assert "pause+sleep" in details[0] and details[1].startswith("wake+resume")
    assert "pause only" in details[2] and details[3].startswith("resume in") and "pause only" in details[4]
    assert "under half the 12.00 GiB margin" in details[5] and details[6].startswith("wake+resume")
    assert "pause+sleep" in details[7]
