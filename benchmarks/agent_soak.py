"""Soak and load figures for the agent on CPU: resource drift over many handoffs, acquire latency under load.

usage: python benchmarks/agent_soak.py [--cycles 1000] [--clients 50 200] [--per-client 5] [--json OUT] [--record DIR]

A real agent (CPU ``sigstop`` backend) with the stand-in vLLM as its tenant. Soak: one trainer job with a
tagged worker process acquires and releases ``--cycles`` times (each cycle thaws and freezes the worker
and moves the tenant); the agent's open fds, threads and RSS are read from /proc before and after.
Load: N clients, each with its own job, acquire and release ``--per-client`` times at once; the acquire
latencies give p50/p99. Prints a table last; ``--record benchmarks/results/agent-soak/DATE-MACHINE`` writes the run's
folder (``soak.json``), which ``benchmarks/readers/agent_soak.py`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from readers.common import add_record_arguments, record
from timeslice_verl.agent.client import AgentClient, wait_for_agent

PY = sys.executable


def proc_figures(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    field = {line.split(":")[0]: line.split(":")[1].split() for line in status if ":" in line}
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(field["Threads"][0]), "rss_kib": int(field["VmRSS"][0])}


def start(workdir: Path) -> tuple[subprocess.Popen, subprocess.Popen, Path]:
    vllm = subprocess.Popen([PY, "-m", "timeslice_verl.standin", "--port", "0", "--token-s", "0.001"],
                            stdout=subprocess.PIPE, text=True)
    url = vllm.stdout.readline().split()[-1]  # type: ignore[union-attr]
    run = workdir / "run"
    run.mkdir(mode=0o700)
    sock = run / "agent.sock"
    agent = subprocess.Popen([PY, "-m", "timeslice_verl", "--log-level", "WARNING", "agent", f"timeslice.agent.socket={sock}",
                              "timeslice.agent.backend=sigstop", f"timeslice.tenant.url={url}"],
                             stdout=open(workdir / "agent.log", "w"), stderr=subprocess.STDOUT)
    wait_for_agent(sock, 60)
    return agent, vllm, sock


def soak(sock: Path, agent_pid: int, cycles: int) -> dict[str, float]:
    env = dict(os.environ, TIMESLICE_JOB="soak-job")
    worker = subprocess.Popen([PY, "-c", "import time\nwhile True: time.sleep(0.01)"], env=env)
    try:
        with AgentClient(sock) as client:
            client.acquire("soak-job")
            client.release("soak-job", wait=True)
            before = proc_figures(agent_pid)
            t0 = time.monotonic()
            for _ in range(cycles):
                client.acquire("soak-job")
                client.release("soak-job", wait=True)
            seconds = time.monotonic() - t0
            after = proc_figures(agent_pid)
    finally:
        worker.kill()
    return {"cycles": cycles, "seconds": round(seconds, 1), **{f"{k}_before": v for k, v in before.items()},
            **{f"{k}_after": v for k, v in after.items()}}


def load(sock: Path, clients: int, per_client: int) -> dict[str, float]:
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def run(i: int) -> None:
        try:
            with AgentClient(sock) as client:
                barrier.wait(60)
                for _ in range(per_client):
                    t0 = time.perf_counter()
                    client.acquire(f"load-{i}", timeout_s=600)
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                    client.release(f"load-{i}")
        except Exception as exc:  # reported, not raised: the figures say how many failed
            with lock:
                errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {"clients": clients, "acquires": len(latencies), "errors": len(errors),
            "p50_ms": round(q[49] * 1e3, 1), "p99_ms": round(q[98] * 1e3, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--clients", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--per-client", type=int, default=5, help="acquire/release cycles of each load client")
    ap.add_argument("--json", default="")
    add_record_arguments(ap)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ts-soak-"))
    agent, vllm, sock = start(workdir)
    try:
        soaked = soak(sock, agent.pid, args.cycles)
        loads = [load(sock, n, args.per_client) for n in args.clients]
    finally:
        agent.terminate()
        agent.wait(60)
        vllm.kill()
    result = {"soak": soaked, "load": loads, "agent_exit": agent.returncode}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    s = soaked
    if args.record:
        raw = workdir / "soak.json"
        raw.write_text(json.dumps(result, indent=1))
        record(args, "agent-soak", [raw], f"{s['cycles']} acquire/release cycles in {s['seconds']} s; the agent's fds "
               f"{s['fds_before']} -> {s['fds_after']}, threads {s['threads_before']} -> {s['threads_after']}.")
    print(f"soak: {s['cycles']} acquire/release cycles in {s['seconds']} s; agent fds {s['fds_before']} -> {s['fds_after']}, "
          f"threads {s['threads_before']} -> {s['threads_after']}, RSS {s['rss_kib_before'] / 1024:.1f} -> {s['rss_kib_after'] / 1024:.1f} MiB")
    print("| clients | acquires | errors | acquire p50 ms | acquire p99 ms |\n|---|---|---|---|---|")
    for r in loads:
        print(f"| {r['clients']} | {r['acquires']} | {r['errors']} | {r['p50_ms']} | {r['p99_ms']} |")
    print(f"agent exit code after SIGTERM: {agent.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
