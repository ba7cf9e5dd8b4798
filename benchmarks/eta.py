"""The ETA's error: the batch service fed by the stand-in vLLM in a fully-async trainer's valleys, each batch's ETA
(``GET /v1/batches/{id}``'s ``timeslice_eta`` field) read through its life against when it really ended.

The gate opens and closes as a fully-async trainer's GPU idles: a seeded :class:`~timeslice_verl.demo.arrivals.RolloutSim`
(``--profile``, ``fleet`` or ``longtail``) delivers samples; the trainer trains ``--train-s`` per step (the gate
closed: the stand-in answers ``/health`` with 500, so the service's gate shuts, and ``/pause?mode=keep`` freezes the
lines in flight, as the agent's yield would) and waits for its next batch of samples (a valley: the gate open).
Batches of seeded sizes, lengths (``max_tokens``), windows, priorities and two owners (weights 1 and 2) arrive over
the first ``--submit-min`` minutes; every open batch is read every ``--poll-s``. The run lasts ``--minutes``.

    nice -n 10 python benchmarks/eta.py --out runs/eta --record benchmarks/results/eta/DATE-cpu

Writes ``observations.jsonl`` (each reading of each batch, its tokens so far beside its ETA), ``batches.jsonl`` (each
batch: what it was, when it ended and how), ``gate.jsonl`` (the valleys), ``speed.jsonl`` (the service's measured
speed, its gate's open seconds and its line counters) and ``meta.json``; the table: ``python benchmarks/figures.py
benchmarks/results/eta/DATE-cpu`` (:mod:`readers.eta`). ``benchmarks/eta_replay.py`` puts a recorded run's readings
through the estimate again, offline (an estimator's variant judged in seconds, not in a run of 30 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from harvest_cpu import free_port, wait_http
from readers.common import add_record_arguments, record
from readers.eta import summary_line
from timeslice_verl.demo.arrivals import PROFILES, RolloutSim, scaled

PY = sys.executable
ENDED = ("completed", "failed", "expired", "cancelled")
KEYS = ("eta-bench-admin-key-0000000000", "eta-bench-team-key-0000000000")


def valleys(profile: str, required: int, valley_s: float, train_s: float, seconds: float, seed: int,
            drift: float | None = None) -> list[tuple[float, float]]:
    """``(open_at, close_at)`` of each valley over ``seconds``: the trainer waits for ``required`` samples (the gate
    open), trains ``train_s`` (closed, production goes on), syncs its weights, and so on (``drift``: how much longer
    responses grow per step, instead of the profile's)."""
    shape = PROFILES[profile] if drift is None else replace(PROFILES[profile], drift=drift)
    sim = RolloutSim(scaled(shape, required=required, valley_s=valley_s), required, seed)
    out, t = [], 0.0
    while t < seconds:
        if sim.take():
            t += train_s
            sim.advance(t)
            sim.sync()
            continue
        start = t
        while sim.queued < sim.required:
            t = sim.next_event()
            sim.advance(t)
        if t > start:
            out.append((start, t))
    return out


class Valleys(threading.Thread):
    """Opens and closes the stand-in (its ``/health`` and ``/pause?mode=keep``) on the schedule, from ``t0``."""

    def __init__(self, tenant: str, schedule: list[tuple[float, float]], t0: float, log: list[dict]) -> None:
        super().__init__(daemon=True)
        self.http, self.schedule, self.t0, self.log = httpx.Client(base_url=tenant, timeout=10), schedule, t0, log
        self.stop = threading.Event()

    def shut(self, closed: bool) -> None:
        self.http.post("/_standin/fault", json={"fail": {"health": [10**9, "500"]} if closed else {}})
        self.http.post("/pause?mode=keep" if closed else "/resume")
        self.log.append({"at": time.time(), "open": not closed})

    def run(self) -> None:
        self.shut(True)
        for start, end in self.schedule:
            for when, closed in ((start, False), (end, True)):
                if self.stop.wait(max(0.0, self.t0 + when - time.monotonic())):
                    return
                self.shut(closed)


def service(state: Path, tenant: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str, Any]:
    state.mkdir(parents=True, exist_ok=True)
    keys = state / "batch.key"
    keys.write_text(f"{KEYS[0]}\n{KEYS[1]} owner=team-b weight=2\n")
    keys.chmod(0o600)
    port = free_port()
    sets = [f"timeslice.batch.port={port}", f"timeslice.batch.db={state / 'batch.sqlite'}",
            f"timeslice.batch.key_file={keys}", f"timeslice.batch.tenant_urls=[{tenant}]", "timeslice.batch.follow_agent=false",
            f"timeslice.batch.concurrency={args.concurrency}", f"timeslice.batch.max_concurrency={args.concurrency * 2}",
            "timeslice.batch.poll_s=0.2"]
    log = open(state / "service.log", "w")
    proc = subprocess.Popen([PY, "-m", "timeslice_verl", "batch", "serve", *[a for s in sets for a in ("--set", s)]],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, "the batch service")
    return proc, url, log


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The batches and when each arrives: seeded sizes, lengths, windows, priorities and owners."""
    rng, out, t = random.Random(args.seed), [], 20.0
    while t < args.submit_min * 60:
        out.append({"at": round(t, 1), "lines": rng.randint(60, 500), "max_tokens": rng.choice((16, 32, 64)),
                    "window": rng.choice(("24h", "24h", "24h", "30m", "20m", "15m")),
                    "priority": rng.choice((0, 0, 0, -10)), "owner": rng.choice((0, 0, 1))})
        t += rng.expovariate(1 / args.every_s)
    return out


def submit(http: list[httpx.Client], b: dict[str, Any], folder: Path, i: int) -> str:
    path = folder / f"in-{i}.jsonl"
    with path.open("w") as f:
        for n in range(b["lines"]):
            body = {"model": "m", "prompt": f"line {n}", "max_tokens": b["max_tokens"]}
            f.write(json.dumps({"custom_id": f"c{n}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    client = http[b["owner"]]
    with path.open("rb") as f:
        fid = client.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}).json()["id"]
    resp = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                            "completion_window": b["window"], "priority": b["priority"]})
    resp.raise_for_status()
    path.unlink()
    return resp.json()["id"]


def drive(args: argparse.Namespace, url: str, out: Path, t0: float) -> list[dict[str, Any]]:
    """Submit the plan's batches on time, read every open batch every ``--poll-s``; the batches as they ended."""
    http = [httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {k}"}) for k in KEYS]
    todo, open_, done = plan(args), {}, []
    obs, speed = (out / "observations.jsonl").open("w"), (out / "speed.jsonl").open("w")
    end = t0 + args.minutes * 60
    while time.monotonic() < end:  # the whole run, also once every batch has ended: the speed is still read
        while todo and time.monotonic() - t0 >= todo[0]["at"]:
            b = todo.pop(0)
            bid = submit(http, b, out, len(done) + len(open_))
            open_[bid] = {**b, "id": bid, "submitted_at": time.time()}
        for bid in list(open_):
            got = http[0].get(f"/v1/batches/{bid}").json()
            c = got["request_counts"]
            obs.write(json.dumps({"id": bid, "at": time.time(), "status": got["status"], "completed": c["completed"],
                                  "failed": c["failed"], "total": c["total"],
                                  "tokens": (got.get("usage") or {}).get("output_tokens"),
                                  **got.get("timeslice_eta", {})}) + "\n")
            if got["status"] in ENDED:
                done.append({**open_.pop(bid), "status": got["status"], "created_at": got["created_at"],
                             "expires_at": got["expires_at"], "ended_at": next(got[k] for k in (
                                 "completed_at", "expired_at", "cancelled_at", "failed_at") if got[k]),
                             "completed": c["completed"]})
        summary = http[0].get("/timeslice/summary").json()
        speed.write(json.dumps({"at": time.time(), "speed": summary.get("speed"), "gate": summary["gate"]["open"],
                                "open_s": summary["gate"]["open_s"], "lines": summary["lines"]}) + "\n")
        obs.flush()
        speed.flush()
        time.sleep(args.poll_s)
    done += [{**b, "status": "unfinished"} for b in open_.values()]
    obs.close()
    speed.close()
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--submit-min", type=float, default=20.0, help="batches arrive over these first minutes")
    ap.add_argument("--every-s", type=float, default=75.0, help="mean seconds between two batches")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="longtail")
    ap.add_argument("--train-s", type=float, default=8.0)
    ap.add_argument("--valley-s", type=float, default=8.0, help="a valley's length at the start (it drifts longer)")
    ap.add_argument("--required", type=int, default=64, help="samples per training step")
    ap.add_argument("--drift", type=float, default=None,
                    help="how much longer responses grow per step (default: the profile's, made for a dozen steps; "
                         "this run has a hundred steps of seconds, a real trainer's last minutes)")
    ap.add_argument("--token-s", type=float, default=0.05)
    ap.add_argument("--knee", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32, help="the stand-in runs at most this many at once too")
    ap.add_argument("--poll-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    add_record_arguments(ap)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    fake = subprocess.Popen([PY, "-m", "timeslice_verl.standin", "--port", str(port), "--token-s", str(args.token_s),
                             "--knee", str(args.knee), "--max-num-seqs", str(args.concurrency)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tenant, gate_log = f"http://127.0.0.1:{port}", []
    schedule = valleys(args.profile, args.required, args.valley_s, args.train_s, args.minutes * 60 + 60, args.seed,
                       args.drift)
    try:
        wait_http(f"{tenant}/health", fake, "the stand-in vLLM")
        proc, url, log = service(args.out / "state", tenant, args)
        t0 = time.monotonic()
        gate = Valleys(tenant, schedule, t0, gate_log)
        gate.start()
        try:
            batches = drive(args, url, args.out, t0)
        finally:
            gate.stop.set()
            proc.terminate()
            proc.wait(60)
            log.close()
    finally:
        fake.terminate()
        fake.wait(30)
    (args.out / "batches.jsonl").write_text("".join(json.dumps(b) + "\n" for b in batches))
    (args.out / "gate.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gate_log))
    share = sum(e - s for s, e in schedule if e <= args.minutes * 60) / (args.minutes * 60)
    meta = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()},
            "valley_share_planned": round(share, 4), "capacity_tokens_per_open_s": args.knee / args.token_s}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    files = [args.out / n for n in ("observations.jsonl", "batches.jsonl", "gate.jsonl", "speed.jsonl", "meta.json")]
    line = summary_line(args.out)
    print(line)
    record(args, "eta", files, line)


if __name__ == "__main__":
    main()
