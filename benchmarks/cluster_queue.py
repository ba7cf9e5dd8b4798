"""Cluster queue benchmark: one PostgreSQL queue fed by 1, 2 and 4 feeders, each beside a stand-in vLLM whose capacity
is known (``--max-num-seqs`` requests at a time, ``--token-s`` a token): lines per second against the tenants'
capacity, and CPU per line of the feeders, the API and the database, measured side by side in one run.

    python benchmarks/cluster_queue.py --out benchmarks/results/cluster-queue/DATE-cpu

Each step: a fresh database on one throwaway server (:mod:`timeslice_verl.testing.postgres`), an API replica
(``batch serve --api-only``) and N feeders (``batch feed``, no agent: ``follow_agent=false``), one batch of
``--lines`` requests of ``--max-tokens`` tokens; the clock runs from the batch's creation to its completion.
Prints a table last; writes ``cluster-queue.json`` (every figure) and each process's log into ``--out``;
``--record benchmarks/results/cluster-queue/DATE-MACHINE`` packs them into the run's folder beside its manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from readers.common import add_record_arguments, record
from timeslice_verl.testing.postgres import Postgres

PY = sys.executable
KEY = "bench-key-" + "x" * 24


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _wait(check: Any, what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not within {timeout} s")


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def _stand_in(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PY, "-m", "timeslice_verl.standin", "--port", "0", "--max-num-seqs",
                             str(args.seqs), "--token-s", str(args.token_s)], stdout=subprocess.PIPE, text=True,
                            stderr=log.open("w"))
    line = proc.stdout.readline()  # type: ignore[union-attr]
    return proc, line.split()[-1]


def step(pg: Postgres, n: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = {**os.environ, "TIMESLICE_BATCH_DSN": pg.database(f"bench_{n}_{os.getpid()}"), "TIMESLICE_BATCH_API_KEY": KEY}
    common = ["timeslice.batch.store=postgresql", "timeslice.batch.follow_agent=false"]
    procs: list[subprocess.Popen] = []
    try:
        api_port = _port()
        api = _spawn([PY, "-m", "timeslice_verl", "batch", "serve", "--api-only", *common,
                      f"timeslice.batch.port={api_port}"], out / f"n{n}-api.log", env)
        procs.append(api)
        feeders = []
        for i in range(n):
            tenant, url = _stand_in(args, out / f"n{n}-tenant{i}.log")
            procs.append(tenant)
            feeder = _spawn([PY, "-m", "timeslice_verl", "batch", "feed", *common, f"timeslice.batch.port={_port()}",
                             f"timeslice.batch.tenant_urls=[{url}]", f"timeslice.batch.concurrency={args.seqs * 2}",
                             "timeslice.batch.adapt_concurrency=false"], out / f"n{n}-feeder{i}.log", env)
            procs.append(feeder)
            feeders.append(feeder)
        http = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", headers={"Authorization": f"Bearer {KEY}"},
                            timeout=120)
        _wait(lambda: http.get("/health").is_success, "the API answers")
        body = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                   "body": {"model": "m", "prompt": f"r{i}", "max_tokens": args.max_tokens}}) + "\n"
                       for i in range(args.lines))
        fid = http.post("/v1/files", files={"file": ("in.jsonl", body.encode())}, data={"purpose": "batch"}).json()["id"]
        server = [psutil.Process(int(pg.postmaster_pid()))]
        watched = {"feeders": [psutil.Process(f.pid) for f in feeders], "api": [psutil.Process(api.pid)]}
        time.sleep(1.0)  # the feeders' first poll of an empty queue is not the batch's
        before = {k: _cpu(v) for k, v in watched.items()} | {"database": _cpu(server + server[0].children())}
        t0 = time.monotonic()
        bid = http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()["id"]
        batch = _wait(lambda: (b := http.get(f"/v1/batches/{bid}").json())["status"] in ("completed", "failed") and b,
                      "the batch ends", timeout=3600)
        wall = time.monotonic() - t0
        after = {k: _cpu(v) for k, v in watched.items()} | {"database": _cpu(server + server[0].children())}
        capacity = n * args.seqs / (args.max_tokens * args.token_s)
        lines_s = batch["request_counts"]["completed"] / wall
        row = {"feeders": n, "lines": args.lines, "completed": batch["request_counts"]["completed"],
               "failed": batch["request_counts"]["failed"], "wall_s": round(wall, 3),
               "lines_per_s": round(lines_s, 1), "capacity_lines_per_s": round(capacity, 1),
               "vs_capacity": round(lines_s / capacity, 3),
               **{f"cpu_ms_per_line_{k}": round((after[k] - before[k]) * 1e3 / max(1, args.lines), 3) for k in after}}
        print(json.dumps(row), flush=True)
        return row
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--feeders", default="1,2,4")
    ap.add_argument("--lines", type=int, default=6000)
    ap.add_argument("--seqs", type=int, default=8, help="each stand-in's requests at a time")
    ap.add_argument("--token-s", type=float, default=0.008, help="each stand-in's seconds a token")
    ap.add_argument("--max-tokens", type=int, default=10)
    add_record_arguments(ap)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pg = Postgres().start()
    rows = []
    try:
        for n in (int(x) for x in args.feeders.split(",")):
            rows.append(step(pg, n, args, args.out))
    finally:
        pg.close()
    meta = {"machine": f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB", "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}}
    (args.out / "cluster-queue.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\n{meta['machine']}; each stand-in {args.seqs} at a time, {args.token_s * 1e3:g} ms a token, "
          f"{args.max_tokens} tokens a line")
    print("| feeders | lines/s | tenants' capacity | vs capacity | CPU ms/line: feeders | API | database |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['feeders']} | {r['lines_per_s']} | {r['capacity_lines_per_s']} | {r['vs_capacity']} | "
              f"{r['cpu_ms_per_line_feeders']} | {r['cpu_ms_per_line_api']} | {r['cpu_ms_per_line_database']} |")
    record(args, "cluster-queue", sorted(args.out.iterdir()), "One PostgreSQL queue, "
           f"{'/'.join(str(r['feeders']) for r in rows)} feeders: "
           f"{', '.join(str(r['vs_capacity']) for r in rows)} of the tenants' capacity.")


if __name__ == "__main__":
    main()
