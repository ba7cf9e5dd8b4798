"""The policy tenant's weight push on a GPU: a trainer process holding the model's weights
pushes them into a real vLLM on the same GPU through vLLM's IPC weight transfer, and greedy outputs follow.

The vLLM must run with ``VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1`` and ``--weight-transfer-config
'{"backend": "ipc"}'`` on the model in ``--model-dir`` (served as ``--served-model-name``). Steps, each timed:

1. greedy answers of the freshly loaded server (the reference: a fresh vLLM with these weights);
2. the weights perturbed in this process (seeded noise), pushed as version 1: the answers change;
3. the original weights pushed back as version 2: the answers equal the fresh server's, token for token;
4. the perturbed weights pushed again as version 3: the answers equal step 2's (a version's answers do not depend
   on what was loaded before it).

Prints a JSON line per step and a table last; ``--out`` gets ``policy_push.json``; ``--record
benchmarks/results/policy-push/DATE-MACHINE`` packs it into the run's folder beside its manifest
(``policy_push_h200.sh`` records its whole ``$OUT``, the logs with it, where ``RECORD`` names the folder).

    python benchmarks/policy_push.py --url http://127.0.0.1:8000 --model-dir /root/model --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import torch

from readers.common import add_record_arguments, record
from timeslice_verl.validate.policy import PolicyTenant
from timeslice_verl.weights import ipc_updates

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "# parse the",
           "for i in range(10):", "with open(path) as f:", "return sorted(", "try:\n    import numpy"]


def greedy(url: str, model: str, max_tokens: int) -> list[str]:
    with httpx.Client(base_url=url, timeout=120) as http:
        out = []
        for p in PROMPTS:
            r = http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                  "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["text"])
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--served", default="m")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--noise", type=float, default=0.02, help="relative noise added to every weight")
    ap.add_argument("--out", type=Path, default=Path("."))
    add_record_arguments(ap)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, torch_dtype=torch.bfloat16).cuda().eval()
    load_s = time.monotonic() - t0
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    perturbed = {n: p + a.noise * p.abs().mean() * torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype)
                 for n, p in original.items()}
    del model
    policy = PolicyTenant(a.url)
    rows: list[dict] = []

    def step(name: str, version: int | None, weights: dict | None) -> list[str]:
        push = policy.push(version, ipc_updates(weights.items())) if weights is not None else None
        answers = greedy(a.url, a.served, a.max_tokens)
        row = {"step": name, "version": version, "push_s": round(push.seconds, 3) if push else None,
               "tensors": push.tensors if push else None, "gb": round(push.bytes / 1e9, 3) if push else None,
               "answers": answers}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "answers"}), flush=True)
        return answers

    fresh = step("fresh", None, None)
    noisy = step("perturbed", 1, perturbed)
    back = step("original again", 2, original)
    again = step("perturbed again", 3, perturbed)
    checks = {"perturbed_changes_answers": noisy != fresh, "original_equals_fresh": back == fresh,
              "perturbed_reproduces": again == noisy}
    result = {"load_s": round(load_s, 2), "checks": checks, "rows": rows,
              "gpu": torch.cuda.get_device_name(0), "params": sum(t.numel() for t in original.values())}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "policy_push.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| step | version | push s | tensors | GB |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['version'] or '–'} | {r['push_s'] or '–'} | {r['tensors'] or '–'} | {r['gb'] or '–'} |")
    print(json.dumps(checks))
    pushes = [r["push_s"] for r in rows if r["push_s"] is not None]
    held = ", ".join(k for k, v in checks.items() if v) or "none"
    record(a, "policy-push", [a.out / "policy_push.json"], f"The trainer's weights pushed into a co-resident vLLM "
           f"through IPC: {min(pushes)}-{max(pushes)} s; checks held: {held}.")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
