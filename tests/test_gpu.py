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


def test_twenty_parks_on_the_gpu_are_bit_identical_and_free_the_tensors():
    """In this process: an fp32 MLP with AdamW parks into pinned host RAM and back, 20 times."""
    torch = pytest.importorskip("torch")
    import standin

    from timeslice_verl.ranks.park import Parker

    model = standin.StandIn(width=2048, depth=8, batch=512, micro=2, device="cuda")
    parker = Parker()
    parker.reserve()
    model.step()
    for cycle in range(20):
        snap = model.snapshot()
        live = torch.cuda.memory_allocated()
        report = parker.park()
        assert report.parked >= model.state_bytes(), (report, model.state_bytes())
        assert report.pin_s == 0.0, f"reserve() pinned enough at the start: {report}"
        left = torch.cuda.memory_allocated()
        assert left < 0.05 * live, f"cycle {cycle}: {left} of {live} bytes still allocated after the park"
        back = parker.unpark()
        assert model.identical_to(snap), f"cycle {cycle}: parameters and optimizer state are bit-identical"
        assert back.parked / back.copy_s > 5e9, f"unpark at {back.parked / back.copy_s / 1e9:.1f} GB/s: not copy-engine speed"
        model.step()


@pytest.mark.parametrize("modes", ["park", "park+checkpoint"])
def test_park_and_park_checkpoint_cycles_through_the_agent_are_bit_identical(tmp_path, procs, modes):
    """The stand-in trainer (benchmarks/swap.py --verify) with the agent's CUDA backend: 20 handoffs."""
    import subprocess

    from agent_support import PY, AgentProc

    gpu = os.environ.get("TIMESLICE_TEST_GPU", "0")
    agent = AgentProc(tmp_path, extra=("timeslice.agent.backend=cuda", f"timeslice.agent.gpus=[{gpu}]")).start()
    procs.append(agent)
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "swap.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, NCCL_P2P_DISABLE="1", TIMESLICE_JOB="gpu-test")
    run = subprocess.run(
        [PY, str(bench), "--socket", str(agent.socket), "--job", "gpu-test", "--modes", modes, "--prepare", "no", "--cycles", "20",
         "--valley", "0.3", "--warmup-valley", "0.3", "--width", "2048", "--depth", "8", "--batch", "512", "--micro", "2",
         "--verify", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=540,
    )
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + agent.log()[-3000:]
    rank = json.loads((tmp_path / "out" / "swap.json").read_text())["ranks"][0]
    (phase,) = rank["phases"]
    assert len(phase["cycles"]) == 20 and all(c["identical"] for c in phase["cycles"]), "bit-identical after every cycle"
    assert phase["losses"] == rank["solo"]["losses"], "the time-sliced run trains exactly as the solo run"
    freezes = [t for c in phase["cycles"] for t in c["transitions"] if t["action"] == "freeze"]
    assert len(freezes) >= 19 and all(t["ok"] for t in freezes)
    if modes == "park":
        assert all("locked only" in t["detail"] for t in freezes)
