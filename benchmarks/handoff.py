"""Handoff benchmark: freeze/thaw a trainer worker through the real agent, N cycles, printed as a table.

    python benchmarks/handoff.py --backend cuda --device cuda --gib 8 --cycles 3   # GPU machine
    python benchmarks/handoff.py --backend sigstop --device cpu --cycles 3         # dry run (no GPU)

Each cycle: ``release`` (the agent locks and checkpoints the worker: its GPU memory moves to host
RAM) then ``acquire`` (restore + unlock); NVML reads the worker's GPU memory after each step and
the worker re-checks a checksum of its data. Timings come from the agent's transition records.
``--json PATH`` writes the raw figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from timeslice_verl.agent.client import AgentClient, wait_for_agent
from timeslice_verl.agent.gpu import process_bytes
from timeslice_verl.demo.procs import Worker


def nvml_used_by(pid: int) -> int | None:
    try:
        return process_bytes(pid)
    except Exception:  # NVML hiccup mid-benchmark: report the cycle without the figure
        return None


def run(backend: str, device: str, gib: float, cycles: int, tenant_url: str = "", workdir: Path | None = None) -> dict[str, Any]:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="ts-bench-"))
    run_dir = workdir / "run"
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = run_dir / "agent.sock"
    log = open(workdir / "agent.log", "w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "timeslice_verl", "agent", f"timeslice.agent.socket={sock}",
         f"timeslice.agent.backend={backend}", f"timeslice.tenant.url={tenant_url}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    worker = None
    results: dict[str, Any] = {"backend": backend, "device": device, "cycles": []}
    try:
        wait_for_agent(sock, 60)
        worker = Worker(device, gib, workdir / "worker.log", job="bench")
        results["worker_bytes"] = worker.nbytes
        with AgentClient(sock) as client:
            client.acquire("bench")
            used0 = nvml_used_by(worker.proc.pid)
            results["gpu_bytes_before"] = used0
            for cycle in range(1, cycles + 1):
                t0 = time.perf_counter()
                rel = client.release("bench", wait=True)
                release_s = time.perf_counter() - t0
                freeze = next(t for t in rel["transitions"] if t["action"] == "freeze" and t["subject"] == "bench")
                used_frozen = nvml_used_by(worker.proc.pid)
                t0 = time.perf_counter()
                acq = client.acquire("bench")
                acquire_s = time.perf_counter() - t0
                thaw = next(t for t in acq["transitions"] if t["action"] == "thaw" and t["subject"] == "bench")
                used_back = nvml_used_by(worker.proc.pid)
                checksum = worker.ask("check").split()[-1]
                step = worker.ask("step 100")
                results["cycles"].append({
                    "cycle": cycle,
                    "bytes": freeze["bytes"],
                    "lock_s": freeze["phases"].get("lock", 0.0),
                    "checkpoint_s": freeze["phases"].get("checkpoint", 0.0),
                    "freeze_s": freeze["end"] - freeze["start"],
                    "restore_s": thaw["phases"].get("restore", 0.0),
                    "unlock_s": thaw["phases"].get("unlock", 0.0),
                    "thaw_s": thaw["end"] - thaw["start"],
                    "release_call_s": release_s,
                    "acquire_call_s": acquire_s,
                    "gpu_bytes_frozen": used_frozen,
                    "gpu_bytes_restored": used_back,
                    "data_intact": checksum == worker.checksum,
                    "step_after_restore": step,
                    "tenant": [t["action"] for t in rel["transitions"] + acq["transitions"] if t["action"].startswith("tenant")],
                })
        results["status"] = AgentClient(sock).status()
    finally:
        agent.terminate()
        try:
            results["agent_exit"] = agent.wait(120)
        except subprocess.TimeoutExpired:
            agent.kill()
            results["agent_exit"] = "killed"
        if worker is not None:
            results["worker_alive_after_agent_stop"] = worker.proc.poll() is None
            results["checksum_after_agent_stop"] = worker.ask("check").split()[-1] == worker.checksum if worker.proc.poll() is None else False
            worker.stop()
        log.close()
        results["agent_log"] = str(workdir / "agent.log")
    return results


def table(results: dict[str, Any]) -> str:
    gb = 1e9
    rows = [
        f"handoff benchmark: backend={results['backend']} device={results['device']} worker={results.get('worker_bytes', 0) / 2**30:.2f} GiB",
        f"{'cyc':>3} {'parked GB':>9} {'lock ms':>8} {'ckpt s':>7} {'GB/s':>6} {'left GB':>8} {'restore s':>9} {'GB/s':>6} {'unlock ms':>9} {'back GB':>8} {'data':>5}",
    ]
    for c in results["cycles"]:
        ck = c["bytes"] / gb / c["checkpoint_s"] if c["checkpoint_s"] and c["bytes"] else 0.0
        rs = c["bytes"] / gb / c["restore_s"] if c["restore_s"] and c["bytes"] else 0.0
        left = "-" if c["gpu_bytes_frozen"] is None else f"{c['gpu_bytes_frozen'] / gb:.3f}"
        back = "-" if c["gpu_bytes_restored"] is None else f"{c['gpu_bytes_restored'] / gb:.2f}"
        rows.append(
            f"{c['cycle']:>3} {c['bytes'] / gb:>9.2f} {c['lock_s'] * 1e3:>8.2f} {c['checkpoint_s']:>7.3f} {ck:>6.2f} {left:>8} "
            f"{c['restore_s']:>9.3f} {rs:>6.2f} {c['unlock_s'] * 1e3:>9.2f} {back:>8} {'ok' if c['data_intact'] else 'BAD':>5}"
        )
    rows.append(f"agent exit {results.get('agent_exit')} · worker restored and intact after agent SIGTERM: "
                f"{results.get('checksum_after_agent_stop')}")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cuda-cli", "sigstop"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--tenant-url", default="")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = run(a.backend, a.device, a.gib, a.cycles, a.tenant_url)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    ok = all(c["data_intact"] for c in results["cycles"]) and len(results["cycles"]) == a.cycles
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
