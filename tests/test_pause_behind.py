"""A pause-only yield the trainer does not wait out (``tenant.pause_grant_s``): vLLM's engine stops at once, its busy
API server answers late; the trainer is granted meanwhile, the pause lands behind the grant, and the next move on the
tenant (the reclaim, the agent's shutdown) waits for it — nothing left paused, no request lost."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

from agent_support import FakeVllmProc, eventually, spawn_worker
from test_hold import AUTO, ScriptedGpu, _ask
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.freeze import make_backend
from timeslice_verl.agent.options import AgentOptions, TenantOptions
from timeslice_verl.agent.state import StateStore


def test_a_pause_answered_late_lands_behind_the_grant_and_the_reclaim_waits_for_it(tmp_path):
    vllm, worker = FakeVllmProc(), spawn_worker("behind-job")
    gpu = ScriptedGpu(vllm, worker.pid)
    threading.Thread(target=_ask, args=(vllm.url,), daemon=True).start()
    eventually(lambda: vllm.stats()["running"] == 1, what="the request runs")

    async def scenario() -> dict:
        a = Arbiter(make_backend("sigstop", probe=None, driver_timeout_s=5), StateStore(tmp_path / "state.json"),
                    probe=gpu, agent=AgentOptions(watch_interval_s=3600),
                    tenant=TenantOptions(warm_up=False, hold=AUTO, pause_grant_s=0.0))
        await a.start()
        await a.register_tenant([vllm.url])
        a.connection_opened(1, None)
        a.register_pids("behind-job", [worker.pid], 1, None)
        seen: dict = {}
        await a.acquire("behind-job", 1)  # its first hold: no peak yet, pause and sleep (awaited)
        await a.watchdog.watch_once()  # its peak: 20 GiB, which fits beside the awake tenant
        await a.release("behind-job", 1, wait=True)
        vllm.post("/_standin/fault", {"late_on": "pause:keep"})  # the engine pauses at once, the answer waits
        await a.acquire("behind-job", 1)  # granted with vLLM's answer still outstanding
        seen["granted"] = {"pending": a.tenancy.behind.pending, "held": a.tenancy.held, "vllm": vllm.stats(),
                           "holding": a.book.jobs["behind-job"].holding}
        release = asyncio.ensure_future(a.release("behind-job", 1, wait=True))  # its reclaim waits for the pause
        await asyncio.to_thread(vllm.post, "/_standin/answer")
        await release
        seen["valley"] = {"vllm": vllm.stats(), "state": a.tenancy.state}
        vllm.post("/_standin/fault", {"late_on": "pause:keep"})
        await a.acquire("behind-job", 1)  # granted again behind a pause; then the agent stops
        seen["second"] = {"pending": a.tenancy.behind.pending}
        stop = asyncio.ensure_future(a.shutdown())
        await asyncio.to_thread(vllm.post, "/_standin/answer")
        await stop
        seen["after_shutdown"] = vllm.stats()
        seen["moves"] = [t for _, t in a.journal.moves if t.action.startswith("tenant_")]
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        vllm.stop()
    granted = seen["granted"]
    assert granted["pending"] and granted["held"] and granted["holding"], granted
    assert granted["vllm"]["paused"] and not granted["vllm"]["sleeping"], "the engine paused; its answer is late"
    assert seen["valley"]["state"] == "awake" and not seen["valley"]["vllm"]["paused"], seen["valley"]
    assert seen["second"]["pending"]
    after = seen["after_shutdown"]
    assert not after["paused"] and not after["sleeping"], "the agent's shutdown left vLLM held"
    assert after["aborted"] == 0 and after["running"] == 1, "the held request runs on: never aborted"
    moves = seen["moves"]
    kinds = [m.action for m in moves]
    assert kinds == ["tenant_yield", "tenant_reclaim"] * 3, kinds
    assert "pause only" in moves[2].detail and moves[3].detail.startswith("resume in")
    assert moves[3].start >= moves[2].start + moves[2].seconds, "the resume was sent before the pause was answered"
    assert "pause only" in moves[4].detail and moves[5].detail.startswith("resume in")
