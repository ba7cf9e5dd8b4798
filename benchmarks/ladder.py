"""How long the trainer waits for its GPU when the tenant misbehaves: the reclaim ladder, measured.

usage: python benchmarks/ladder.py [--deadline 2] [--repeat 3] [--json OUT] [--record DIR]
                                   [--vllm-url URL --vllm-pid PID]   (a real vLLM, tagged TIMESLICE_TENANT=1)

Each scenario starts a real agent (CPU ``sigstop`` backend: what is measured is the tenant's side), a job
worker tagged ``TIMESLICE_JOB`` and, for the stand-in scenarios, a stand-in vLLM tagged ``TIMESLICE_TENANT=1``
with one fault injected. The trainer's acquire is timed while the tenant is awake (so its yield is in the
way); the ladder step the agent took and the tenant's state afterwards come from ``status``. With a real
vLLM: ``vllm-keep`` times acquire/release cycles under load (pause ``keep``), ``vllm-stopped`` SIGSTOPs the
server (it answers nothing) and times the acquire that the ladder ends by killing it (last: it kills it).
Prints a table last; ``--json`` keeps every acquire (``ladder.json``; ``ladder-vllm.json`` with a real vLLM: the
reader tells them by name); ``--record benchmarks/results/ladder/DATE-MACHINE`` packs it and ``--log-dir``'s logs
into the run's folder beside its manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from readers.common import add_record_arguments, record
from timeslice_verl.agent.client import AgentClient, wait_for_agent

PY = sys.executable
STANDIN = {
    "behaving": [],
    "hang-pause": ["--hang", "pause"],
    "hang-pause-keep": ["--hang", "pause:keep"],
    "hang-sleep": ["--hang", "sleep"],
    "slow-1.5s": ["--slow-s", "1.5"],
    "dies-at-pause": ["--die-on", "pause"],
    "hang-health": ["--hang", "health"],
}


def _standin(args: list[str]) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, TIMESLICE_TENANT="1")
    proc = subprocess.Popen([PY, "-m", "timeslice_verl.standin", "--port", "0", *args], stdout=subprocess.PIPE,
                            text=True, env=env)
    return proc, proc.stdout.readline().split()[-1]  # type: ignore[union-attr]


def _agent(workdir: Path, url: str, deadline: float) -> tuple[subprocess.Popen, Path]:
    run = workdir / "run"
    run.mkdir(mode=0o700)
    sock = run / "agent.sock"
    agent = subprocess.Popen([PY, "-m", "timeslice_verl", "--log-level", "INFO", "agent", f"timeslice.agent.socket={sock}",
                              "timeslice.agent.backend=sigstop", f"timeslice.tenant.url={url}", f"timeslice.agent.lock_dir={run}",
                              f"timeslice.tenant.reclaim_deadline_s={deadline}"],
                             stdout=open(workdir / "agent.log", "w"), stderr=subprocess.STDOUT)
    wait_for_agent(sock, 60)
    return agent, sock


def _worker(job: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", "import time\nwhile True: time.sleep(0.01)"], env=dict(os.environ, TIMESLICE_JOB=job))


def _stop(*procs: subprocess.Popen | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except OSError:
                pass
            p.kill()
            p.wait(10)


def _timed_acquire(client: AgentClient, job: str) -> dict[str, Any]:
    t0 = time.monotonic()
    reply = client.acquire(job, timeout_s=600)
    seconds = time.monotonic() - t0
    status = client.status()
    yields = [t for t in reply["transitions"] if t["action"] == "tenant_yield"]
    step = "kill" if status["ladder"].get("kill") else "abort" if status["ladder"].get("abort") else "polite"
    return {"acquire_s": round(seconds, 4), "step": step, "tenant": (status["tenant"] or {}).get("state", ""),
            "yield_detail": yields[-1]["detail"] if yields else "", "owner": status["owner"]}


def standin(name: str, deadline: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ladder-") as tmp:
        vllm, url = _standin(STANDIN[name])
        agent, worker = None, None
        try:
            agent, sock = _agent(Path(tmp), url, deadline)
            worker = _worker("ladder-job")
            time.sleep(0.5)  # the worker's tag readable in /proc before the agent scans for it
            with AgentClient(sock) as client:
                out = _timed_acquire(client, "ladder-job")
            out["tenant_alive_after"] = vllm.poll() is None
            return out
        finally:
            _stop(worker, agent, vllm)


def _load(url: str, stop: threading.Event, results: dict[str, int]) -> None:
    import httpx

    with httpx.Client(timeout=300) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        while not stop.is_set():
            try:
                r = client.post(f"{url}/v1/completions", json={"model": model, "prompt": "count:", "max_tokens": 256})
                results["ok" if r.is_success else "failed"] += 1
            except httpx.HTTPError:
                results["failed"] += 1


def real_vllm(url: str, pid: int, deadline: float, cycles: int, log_dir: Path | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ladder-") as tmp:
        agent, sock = _agent(Path(tmp), url, deadline)
        worker = _worker("ladder-job")
        stop, results = threading.Event(), {"ok": 0, "failed": 0}
        load = [threading.Thread(target=_load, args=(url, stop, results), daemon=True) for _ in range(8)]
        try:
            time.sleep(0.5)
            for t in load:
                t.start()
            with AgentClient(sock) as client:
                for _ in range(cycles):
                    time.sleep(2.0)  # the tenant serves the valley
                    row = _timed_acquire(client, "ladder-job")
                    row["scenario"] = "vllm-keep"
                    rows.append(row)
                    client.release("ladder-job", wait=True)
                time.sleep(2.0)
                stop.set()
                for t in load:
                    t.join(300)
                for row in rows:
                    row["requests_ok"], row["requests_failed"] = results["ok"], results["failed"]
                os.kill(pid, signal.SIGSTOP)  # the server answers nothing from now on
                row = _timed_acquire(client, "ladder-job")
                row["scenario"] = "vllm-stopped"
                time.sleep(1.0)
                row["tenant_alive_after"] = Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)
                rows.append(row)
        finally:
            stop.set()
            _stop(worker, agent)
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                (log_dir / "agent.log").write_text((Path(tmp) / "agent.log").read_text())
    return rows


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return "gone"


def table(rows: list[dict[str, Any]], deadline: float) -> str:
    lines = [f"| scenario (deadline {deadline:g} s) | acquires | acquire s (median / max) | ladder step | tenant after |",
             "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["scenario"] for r in rows):
        rs = [r for r in rows if r["scenario"] == name]
        waits = [r["acquire_s"] for r in rs]
        steps = ", ".join(sorted({r["step"] for r in rs}))
        after = ", ".join(sorted({r["tenant"] + ("" if r.get("tenant_alive_after", True) else " (process gone)") for r in rs}))
        lines.append(f"| {name} | {len(rs)} | {statistics.median(waits):.2f} / {max(waits):.2f} | {steps} | {after} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--vllm-url")
    ap.add_argument("--vllm-pid", type=int)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--log-dir", type=Path, help="keep the agent's log there (real vLLM)")
    add_record_arguments(ap)
    args = ap.parse_args()
    if args.record and not args.json:
        ap.error("--record packs --json's file: give --json too")
    rows: list[dict[str, Any]] = []
    if args.vllm_url:
        rows += real_vllm(args.vllm_url, args.vllm_pid, args.deadline, args.cycles, args.log_dir)
    else:
        for name in STANDIN:
            for _ in range(args.repeat):
                rows.append({"scenario": name, **standin(name, args.deadline)})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"deadline_s": args.deadline, "python": sys.version.split()[0],
                                         "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    print(table(rows, args.deadline))
    logs = [p for p in sorted(args.log_dir.iterdir()) if p.resolve() != args.json.resolve()] \
        if args.record and args.log_dir and args.log_dir.is_dir() else []
    record(args, "ladder", [args.json, *logs], f"The slowest acquire {max(r['acquire_s'] for r in rows):.2f} s against "
           f"the {args.deadline:g} s reclaim deadline, over {len(rows)} acquires.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
