"""GPU tests (H200 machine): real CUDA checkpoint/restore through the agent's API.

Run there with ``python -m pytest -m gpu -s``; CI has no GPU and skips them with the reason.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.gpu

GIB = 2**30


def test_cuda_backend_checkpoints_and_restores_a_torch_process_through_the_agent(tmp_path):
    pytest.importorskip("torch")
    import handoff

    results = handoff.run("cuda", "cuda", gib=8.5, cycles=3, workdir=tmp_path)
    print("\n" + handoff.table(results))
    out = os.environ.get("TIMESLICE_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=str))
    assert len(results["cycles"]) == 3, Path(results["agent_log"]).read_text()[-3000:]
    assert results["gpu_bytes_before"] >= 8 * GIB
    for cycle in results["cycles"]:
        assert cycle["bytes"] >= 8 * GIB, "the freeze moved the worker's memory off the GPU"
        assert cycle["gpu_bytes_frozen"] is not None and cycle["gpu_bytes_frozen"] < 0.5 * GIB, "NVML: memory freed"
        assert cycle["gpu_bytes_restored"] >= 0.95 * cycle["bytes"], "NVML: memory returned"
        assert cycle["data_intact"], "data survived checkpoint/restore"
        assert cycle["step_after_restore"].startswith("done"), "the worker computes again after restore"
        assert cycle["lock_s"] > 0 and cycle["checkpoint_s"] > 0 and cycle["restore_s"] > 0 and cycle["unlock_s"] > 0
    assert results["agent_exit"] == 0 and results["checksum_after_agent_stop"]


def test_real_vllm_tenant_sleeps_and_wakes_through_the_agent(tmp_path):
    """With a real vLLM (TIMESLICE_VLLM_URL; started with VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode)."""
    url = os.environ.get("TIMESLICE_VLLM_URL")
    if not url:
        pytest.skip("set TIMESLICE_VLLM_URL to a vLLM started with VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode")
    import threading
    import time

    import httpx

    from agent_support import AgentProc, spawn_worker

    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "def f(x):", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    agent = AgentProc(tmp_path, tenant_url=url, extra=("timeslice.agent.backend=cuda",)).start()
    worker = spawn_worker("vllm-job")
    try:
        free_awake = agent.status()["gpu"]["free"]
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()))
        t.start()
        time.sleep(0.5)  # the request is being generated
        queued = {}

        def during_pause():  # arrives while the agent waits for the in-flight request: queued across the sleep
            time.sleep(0.3)
            queued["r"] = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 16}, timeout=300).json()

        t3 = threading.Thread(target=during_pause)
        with agent.client() as c:
            t0 = time.monotonic()
            t3.start()
            res = c.acquire("vllm-job")
            acquire_s = time.monotonic() - t0
            t.join(120)
            assert out["r"]["choices"][0]["finish_reason"] != "abort", "the in-flight request completed"
            assert httpx.get(f"{url}/is_sleeping", timeout=30).json()["is_sleeping"] is True
            free_asleep = agent.status()["gpu"]["free"]
            assert free_asleep - free_awake > 10 * GIB, "vLLM's memory came free while asleep"
            late = {}
            t2 = threading.Thread(target=lambda: late.setdefault("r", httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 8}, timeout=300).json()))
            t2.start()
            time.sleep(1.0)
            assert "r" not in late, "requests wait while the trainer holds the GPU"
            rel = c.release("vllm-job", wait=True)
            t2.join(120)
            t3.join(120)
            assert late["r"]["choices"][0]["finish_reason"] != "abort"
            assert queued["r"]["choices"][0]["finish_reason"] != "abort", "a request queued during the pause survives the sleep"
        yields = [t for t in res["transitions"] if t["action"] == "tenant_yield"]
        reclaims = [t for t in rel["transitions"] if t["action"] == "tenant_reclaim"]
        print(f"\nreal vLLM: acquire with a request in flight {acquire_s:.2f} s; yield {yields[0]['end'] - yields[0]['start']:.3f} s; "
              f"reclaim {reclaims[0]['end'] - reclaims[0]['start']:.3f} s; freed {(free_asleep - free_awake) / GIB:.1f} GiB")
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json()["is_sleeping"] is False
    finally:
        worker.kill()
        agent.stop()
