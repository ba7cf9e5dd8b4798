"""The batch service alone, on CPU: lines/s and the service's CPU per line at 2 000, 20 000
and 50 000 lines against the stand-in vLLM, whose capacity is known (``knee / (max_tokens × token_s)`` lines/s);
the CPU per line of a batch's first tenth and last tenth; the service's peak memory through a 200 MB upload.

``--baseline-src DIR`` runs a second service from another source tree (``git worktree add DIR REV``) on the same
stand-in, one after the other, for a side-by-side ratio. Raw samples go to ``--out`` as JSONL, a table is printed
last and written as ``table.md``.

    python benchmarks/harvest_cpu.py --out benchmarks/results/harvest/DATE-cpu [--baseline-src ../old/src]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

PY = sys.executable
ENDED = ("completed", "failed", "expired", "cancelled")
"""``timeslice_verl.batch.status.ENDED``, spelled out: this script imports nothing of the trees it measures."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} did not answer at {url}")


class Service:
    """``timeslice-verl batch serve`` from ``src`` (None: this tree), its state in ``state``."""

    def __init__(self, src: str | None, state: Path, tenant: str, settings: list[str]) -> None:
        state.mkdir(parents=True, mode=0o700, exist_ok=True)
        self.port, self.state = free_port(), state
        env = dict(os.environ, **({"PYTHONPATH": src} if src else {}))
        args = [PY, *(os.environ.get("HARVEST_SERVICE_CMD", "-m timeslice_verl").split()), "batch", "serve", *[a for kv in (
            f"timeslice.batch.port={self.port}", f"timeslice.batch.db={state / 'batch.sqlite'}",
            f"timeslice.batch.key_file={state / 'batch.key'}", f"timeslice.batch.tenant_url={tenant}",
            "timeslice.batch.follow_agent=false", *settings) for a in ("--set", kv)]]
        self.log = open(state / "service.log", "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(f"{self.url}/health", self.proc, "the batch service")
        key = (state / "batch.key").read_text().strip()
        self.http = httpx.Client(base_url=self.url, timeout=600, headers={"Authorization": f"Bearer {key}"})
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def write_input(path: Path, n: int, max_tokens: int, prompt_bytes: int = 24) -> None:
    pad = "x" * max(0, prompt_bytes - 12)
    with path.open("w") as f:
        for i in range(n):
            body = {"model": "m", "prompt": f"line {i} {pad}", "max_tokens": max_tokens}
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def submit(svc: Service, path: Path) -> str:
    with path.open("rb") as f:
        resp = svc.http.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"})
    if resp.status_code != 200:
        raise SystemExit(f"the service refused {path.name}: HTTP {resp.status_code}: {resp.text[:300]}")
    fid = resp.json()["id"]
    resp = svc.http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                              "completion_window": "24h"})
    resp.raise_for_status()
    return resp.json()["id"]


def run_batch(svc: Service, path: Path, n: int, samples: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """Submit, follow to the end (every 0.25 s); the figures of the whole batch, its first and last tenth."""
    cpu0, t0 = svc.cpu(), time.monotonic()
    bid = submit(svc, path)
    cpu_sub = svc.cpu() - cpu0
    marks: dict[str, tuple[float, float, int]] = {}
    while True:
        b = svc.http.get(f"/v1/batches/{bid}").json()
        done = b["request_counts"]["completed"] + b["request_counts"]["failed"]
        now, cpu = time.monotonic(), svc.cpu()
        samples.append({"label": label, "lines": n, "t": round(now - t0, 3), "done": done, "cpu_s": round(cpu - cpu0, 4),
                        "rss_mib": round(svc.ps.memory_info().rss / 2**20, 1)})
        for name, share in (("first", 0.0), ("tenth", 0.1), ("nine", 0.9)):
            if name not in marks and done >= share * n:
                marks[name] = (now, cpu, done)
        if b["status"] in ENDED:
            marks["end"] = (now, cpu, done)
            break
        time.sleep(0.25)
    (ta, ca, da), (tb, cb, db_) = marks["first"], marks["tenth"]
    (tc, cc, dc), (te, ce, de) = marks["nine"], marks["end"]
    feeding_s = te - t0
    return {"label": label, "lines": n, "status": b["status"], "completed": b["request_counts"]["completed"],
            "wall_s": round(feeding_s, 2), "lines_per_s": round(n / feeding_s, 1),
            "cpu_ms_per_line": round((ce - cpu0) / n * 1000, 3), "submit_cpu_s": round(cpu_sub, 2),
            "cpu_ms_per_line_first_tenth": round((cb - ca) / max(1, db_ - da) * 1000, 3),
            "cpu_ms_per_line_last_tenth": round((ce - cc) / max(1, de - dc) * 1000, 3),
            "peak_rss_mib": max(s["rss_mib"] for s in samples if s["label"] == label and s["lines"] == n),
            "db_mib": round(sum(p.stat().st_size for p in svc.state.glob("batch.sqlite*")) / 2**20, 1)}


def upload_peak(svc: Service, path: Path, out: Path) -> dict[str, Any]:
    """Peak RSS of the service while it takes a large file and makes a batch of it (then cancelled)."""
    peak, stop = [svc.ps.memory_info().rss], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak.append(svc.ps.memory_info().rss)
            time.sleep(0.02)

    before = svc.ps.memory_info().rss
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    bid = submit(svc, path)
    stop.set()
    t.join()
    svc.http.post(f"/v1/batches/{bid}/cancel")
    return {"file_mb": round(path.stat().st_size / 2**20, 1), "rss_before_mib": round(before / 2**20, 1),
            "rss_peak_mib": round(max(peak) / 2**20, 1), "rss_after_mib": round(svc.ps.memory_info().rss / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000, 50000])
    ap.add_argument("--token-s", type=float, default=0.004)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--knee", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--baseline-src", default="", help="another tree's src/ to run side by side (before/after)")
    ap.add_argument("--baseline-sizes", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--upload-mb", type=float, default=190.0, help="0: skip the large upload (the service takes 200 MiB)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / "state"
    port = free_port()
    fake = subprocess.Popen([PY, "-m", "timeslice_verl.standin", "--port", str(port), "--token-s", str(a.token_s),
                             "--knee", str(a.knee), "--max-num-seqs", str(a.max_num_seqs)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tenant = f"http://127.0.0.1:{port}"
    rows, samples, extra = [], [], {}
    try:
        wait_http(f"{tenant}/health", fake, "the stand-in vLLM")
        capacity = a.knee / (a.max_tokens * a.token_s)
        for label, src, sizes in (("this tree", None, a.sizes), ("baseline", a.baseline_src, a.baseline_sizes)):
            if label == "baseline" and not src:
                continue
            svc = Service(src, tmp / label.replace(" ", "-"), tenant, [])
            try:
                for n in sizes:
                    path = tmp / f"in-{n}.jsonl"
                    write_input(path, n, a.max_tokens)
                    rows.append(run_batch(svc, path, n, samples, label))
                    print(json.dumps(rows[-1]), flush=True)
                if label == "this tree" and a.upload_mb > 0:
                    big = tmp / "big.jsonl"
                    write_input(big, 50_000, a.max_tokens, prompt_bytes=int(a.upload_mb * 2**20 / 50_000) - 110)
                    extra["upload"] = upload_peak(svc, big, a.out)
                    big.unlink()
            finally:
                svc.stop()
    finally:
        fake.terminate()
        fake.wait(30)
    import shutil

    shutil.rmtree(tmp)  # inputs, databases and keys: the figures are in rows.jsonl and samples.jsonl
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, {platform()}", "args": vars(a) | {
        "out": str(a.out), "baseline_src": bool(a.baseline_src)}, "standin_capacity_lines_per_s": capacity, **extra}
    (a.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (a.out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    table = [f"stand-in capacity {capacity:.0f} lines/s (knee {a.knee}, {a.max_tokens} tokens of {a.token_s * 1000:.0f} ms)",
             "", "| service | lines | lines/s | CPU ms/line | first tenth | last tenth | peak RSS MiB | database MiB |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['label']} | {r['lines']} | {r['lines_per_s']} | {r['cpu_ms_per_line']} | "
              f"{r['cpu_ms_per_line_first_tenth']} | {r['cpu_ms_per_line_last_tenth']} | {r['peak_rss_mib']} | "
              f"{r.get('db_mib', '–')} |" for r in rows]
    if "upload" in extra:
        u = extra["upload"]
        table += ["", f"upload of {u['file_mb']} MB (50 000 lines): RSS {u['rss_before_mib']} → peak {u['rss_peak_mib']} "
                      f"→ after {u['rss_after_mib']} MiB"]
    (a.out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


def platform() -> str:
    import platform as p

    return f"{p.system()} {p.release()}, Python {p.python_version()}"


if __name__ == "__main__":
    main()
