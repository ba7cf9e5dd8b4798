"""Who got what, against the server's own counters: two owners' batches through the batch service, and what the
service attributes to each — their batch objects' ``usage``, ``/timeslice/summary``'s owners, the owner metrics —
summed against the tokens the tenant itself says it took in and generated (vLLM's ``/metrics``:
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``).

The service runs on its own (``follow_agent=false``: it sends while the tenant answers), with a key for each owner
(weights 3 and 1) and an admin key that reads every owner's figures; the tenant serves nothing else meanwhile. ::

    python benchmarks/attribution.py --vllm-url http://127.0.0.1:8000 --out DIR [--lines 200] [--max-tokens 128]

Writes ``attribution.json`` (every figure) and the service's log; prints a table last. On the CPU, against the
stand-in (``timeslice-verl tenant standin``), it is ``tests/test_attribution_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harvest_cpu import free_port, wait_http  # noqa: E402
from resume_vllm import token_counters  # noqa: E402

KEYS = {"ops": "attribution-admin-key-00000000000", "team-a": "attribution-team-a-key-0000000000",
        "team-b": "attribution-team-b-key-0000000000"}
WEIGHTS = {"team-a": 3, "team-b": 1}
METRIC = "timeslice_batch_owner_"
ENDED = ("completed", "failed", "expired", "cancelled")


def start_service(state: Path, tenant: str) -> tuple[subprocess.Popen, str]:
    """``timeslice-verl batch serve`` on a free port, fed to ``tenant`` alone, its keys in ``state``."""
    state.mkdir(parents=True, exist_ok=True)
    keys = state / "batch.key"
    keys.write_text(f"{KEYS['ops']} owner=ops role=admin\n" +
                    "".join(f"{KEYS[o]} owner={o} weight={w}\n" for o, w in WEIGHTS.items()))
    keys.chmod(0o600)
    port = free_port()
    sets = [f"timeslice.batch.port={port}", f"timeslice.batch.db={state / 'batch.sqlite'}",
            f"timeslice.batch.key_file={keys}", f"timeslice.batch.tenant_urls=[{tenant}]",
            "timeslice.batch.follow_agent=false", "timeslice.batch.poll_s=0.2"]
    with (state / "service.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "timeslice_verl", "batch", "serve",
                                 *[a for s in sets for a in ("--set", s)]], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, "the batch service")
    return proc, url


def submit(client: httpx.Client, owner: str, lines: int, max_tokens: int, model: str, folder: Path) -> str:
    """A batch of ``lines`` completions whose prompts differ per owner and line."""
    path = folder / f"input-{owner}.jsonl"
    with path.open("w") as f:
        for n in range(lines):
            body = {"model": model, "prompt": f"{owner} asks, line {n}: tell a story about the number {n}",
                    "max_tokens": max_tokens, "temperature": 0.0}
            f.write(json.dumps({"custom_id": f"{owner}-{n}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")
    with path.open("rb") as f:
        fid = client.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}).json()["id"]
    made = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                            "completion_window": "24h"})
    made.raise_for_status()
    return made.json()["id"]


def owner_metrics(text: str) -> dict[str, dict[str, float]]:
    """The service's owner counters, ``{owner: {figure: value}}`` (``timeslice_batch_owner_<figure>{owner=…}``)."""
    got: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC) or "{" not in line:
            continue
        name, rest = line[len(METRIC):].split("{", 1)
        labels, value = rest.rsplit("}", 1)
        owner = dict(p.split("=", 1) for p in labels.split(",") if "=" in p).get("owner", "").strip('"')
        got.setdefault(owner, {})[name.removesuffix("_total")] = float(value)
    return got


def measure(url: str, tenant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both owners' batches from submission to their end; every count beside the tenant's."""
    clients = {o: httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {k}"})
               for o, k in KEYS.items()}
    with httpx.Client(base_url=tenant, timeout=30) as server:
        model = server.get("/v1/models").json()["data"][0]["id"]
        before = token_counters(server.get("/metrics").text)
        ids = {o: submit(clients[o], o, args.lines, args.max_tokens, model, args.out) for o in WEIGHTS}
        deadline = time.monotonic() + args.timeout_s
        batches = {}
        while time.monotonic() < deadline:
            batches = {o: clients[o].get(f"/v1/batches/{b}").json() for o, b in ids.items()}
            if all(b["status"] in ENDED for b in batches.values()):
                break
            time.sleep(0.5)
        after = token_counters(server.get("/metrics").text)
    summary = clients["ops"].get("/timeslice/summary").json()
    metrics = owner_metrics(clients["ops"].get("/metrics").text)
    for c in clients.values():
        c.close()
    owners = {o["owner"]: o for o in summary.get("owners", [])}
    return {"batches": batches, "owners": owners, "metrics": metrics,
            "server": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}}


def figures(got: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per source of the service's attribution: input and output tokens summed over the two owners."""
    rows = []
    for source, per in (("batch objects' usage", {o: b.get("usage") or {} for o, b in got["batches"].items()}),
                        ("/timeslice/summary owners", {o: got["owners"].get(o, {}) for o in WEIGHTS}),
                        ("metrics, owner label", {o: got["metrics"].get(o, {}) for o in WEIGHTS})):
        rows.append({"source": source, "input": sum(float(p.get("input_tokens", 0)) for p in per.values()),
                     "output": sum(float(p.get("output_tokens", 0)) for p in per.values()),
                     "by_owner": {o: [p.get("input_tokens"), p.get("output_tokens")] for o, p in per.items()}})
    server = got["server"]
    rows.append({"source": "the tenant's own counters", "input": server.get("vllm:prompt_tokens_total", 0.0),
                 "output": server.get("vllm:generation_tokens_total", 0.0), "by_owner": {}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-url", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=200, help="lines per owner's batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = start_service(args.out / "service", args.vllm_url)
    try:
        got = measure(url, args.vllm_url, args)
    finally:
        proc.terminate()
        proc.wait(30)
    got["rows"] = figures(got)
    (args.out / "attribution.json").write_text(json.dumps(got, indent=1))
    print("| where | input tokens | output tokens | team-a (in, out) | team-b (in, out) |\n|---|---|---|---|---|")
    for r in got["rows"]:
        owners = [r["by_owner"].get(o, ["–", "–"]) for o in WEIGHTS]
        print(f"| {r['source']} | {r['input']:.0f} | {r['output']:.0f} | " +
              " | ".join(f"{a}, {b}" for a, b in owners) + " |")
    return 0 if all(b["status"] == "completed" for b in got["batches"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
