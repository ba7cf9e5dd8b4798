"""GPU memory of every process of a verl run, by role, sampled until a stop file appears; and its reader.

usage: python gpumem.py OUT.jsonl --stop-file PATH [--interval-s 2]
Each line: ``{"t": epoch s, "used_mib": {gpu index: MiB}, "procs": [{"pid", "gpu", "mib", "role", "title"}]}`` from
``nvidia-smi --query-compute-apps`` and ``/proc``. A process's role comes from its own and its ancestors' titles (Ray
names its actors ``ray::Class``; vLLM's workers are children of ``ray::vLLMHttpServer``) or, for the vLLMs run.sh
starts itself, from ``TIMESLICE_RUN_ROLE`` in their environment. Without nvidia-smi it writes nothing and ends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

ROLE_ENV = "TIMESLICE_RUN_ROLE"
TITLES = (
    ("ray::WorkerDict", "trainer"),
    ("ray::CheckpointEngineWorker", "rollout receiver"),
    ("ray::vLLMHttpServer", "rollout vLLM"),
)
ROLES = ("trainer", "rollout vLLM", "rollout receiver", "tenant", "policy", "other")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def title(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


def parent(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    fields = stat.rpartition(")")[2].split()
    return int(fields[1]) if len(fields) > 1 else 0


def _tag(pid: int) -> str:
    for entry in _read(f"/proc/{pid}/environ").split(b"\0"):
        if entry.startswith(ROLE_ENV.encode() + b"="):
            return entry.split(b"=", 1)[1].decode()
    return ""


def role_of(pid: int) -> str:
    """The process's role in the run: from its or an ancestor's tag (vLLM's ``VLLM::EngineCore`` sets its title over
    its own environment's memory, so its tag is read from its parent), else its or an ancestor's title."""
    walk, seen = pid, 0
    while walk > 1 and seen < 3:
        if tag := _tag(walk):
            return tag
        walk, seen = parent(walk), seen + 1
    walk, seen = pid, 0
    while walk > 1 and seen < 8:
        text = title(walk)
        for marker, role in TITLES:
            if marker in text:
                return role
        walk, seen = parent(walk), seen + 1
    return "other"


def sample() -> dict[str, Any]:
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30).stdout
    index = {}
    used = {}
    for line in gpus.splitlines():
        i, uuid, mib = (x.strip() for x in line.split(","))
        index[uuid], used[i] = i, int(mib)
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30).stdout
    procs = []
    for line in apps.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
            continue
        pid = int(parts[0])
        procs.append({"pid": pid, "gpu": index.get(parts[1], parts[1]), "mib": int(parts[2]), "role": role_of(pid),
                      "title": title(pid)[:120]})
    return {"t": time.time(), "used_mib": used, "procs": procs}


def monitor(out: Path, stop: Path, interval_s: float) -> None:
    with out.open("a") as f:
        while not stop.exists():
            try:
                f.write(json.dumps(sample()) + "\n")
                f.flush()
            except (subprocess.SubprocessError, ValueError) as exc:  # a sample lost, not the run's record
                f.write(json.dumps({"t": time.time(), "error": str(exc)}) + "\n")
            time.sleep(interval_s)


def by_role(path: Path) -> dict[str, dict[str, float]]:
    """Per role: its GiB summed over its processes in each sample, the peak and the median of the samples it held any."""
    if not path.exists():
        return {}
    series: dict[str, list[int]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        sums: dict[str, int] = {}
        for p in rec.get("procs", []):
            sums[p["role"]] = sums.get(p["role"], 0) + p["mib"]
        for role, mib in sums.items():
            series.setdefault(role, []).append(mib)
    return {role: {"peak_gib": round(max(v) / 1024, 2), "median_gib": round(statistics.median(v) / 1024, 2)}
            for role, v in sorted(series.items(), key=lambda kv: ROLES.index(kv[0]) if kv[0] in ROLES else 99)}


def peak_used(path: Path) -> float | None:
    """The GPU's highest used memory of the run, GiB (all processes, the device's own count)."""
    if not path.exists():
        return None
    peaks = [max(r["used_mib"].values()) for r in map(json.loads, filter(str.strip, path.read_text().splitlines()))
             if r.get("used_mib")]
    return round(max(peaks) / 1024, 2) if peaks else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--interval-s", type=float, default=2.0)
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None:
        return 0
    monitor(args.out, args.stop_file, args.interval_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
