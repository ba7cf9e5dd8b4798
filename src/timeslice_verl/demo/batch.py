"""The demo's batch work: one batch submitted to the node's batch service at the start, more lines than the run
can answer, and at the end what the tenant made of it — lines completed, retried, failed, and lines and tokens
per second of the time the tenant had the GPU. The lines not sent when the run ends are cancelled (the batch's
error file says so, line by line)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from timeslice_verl.batch.client import ENDED, BatchClient, BatchClientError, served_model
from timeslice_verl.log import get_logger

log = get_logger("demo")

PROMPTS = ("def fibonacci(n):", "The capital of France is", "Write a haiku about GPUs:", "SELECT * FROM",
           "Once upon a time,", "import numpy as np\n", "The three laws of motion are", "Q: What is 17 * 23?\nA:")


def write_input(path: Path, lines: int, model: str, max_tokens: int) -> Path:
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": model, "prompt": f"{PROMPTS[i % len(PROMPTS)]} #{i}", "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True}  # every line its max_tokens: a mix of known length
            f.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


class DemoBatch:
    def __init__(self, service_url: str, api_key: str, tenant_url: str, out: Path, *, lines: int, max_tokens: int) -> None:
        self.client, self.out = BatchClient(service_url, api_key), out
        self.tenant_url, self.lines, self.max_tokens = tenant_url, lines, max_tokens
        self.id = ""

    def submit(self) -> DemoBatch:
        path = write_input(self.out / "batch-input.jsonl", self.lines, served_model(self.tenant_url), self.max_tokens)
        self.id = self.client.create(self.client.upload(path)["id"], "/v1/completions")["id"]
        log.info("demo: batch %s of %d lines submitted", self.id, self.lines)
        return self

    def finish(self, timeout_s: float = 120.0, *, complete_within_s: float = 0.0) -> dict[str, Any]:
        """Let the batch complete (up to ``complete_within_s``), cancel what is left, wait for the lines in flight,
        fetch the files; the figures."""
        try:
            batch = self._wait(self.client.get(self.id), complete_within_s)
            if batch["status"] not in ENDED:
                batch = self._wait(self.client.cancel(self.id), timeout_s)
            return self._figures(batch)
        except BatchClientError as exc:
            log.error("demo: the batch's figures are lost: %s", exc)
            return {"error": str(exc)}
        finally:
            self.client.close()

    def _wait(self, batch: dict[str, Any], seconds: float) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        while batch["status"] not in ENDED and time.monotonic() < deadline:
            time.sleep(0.5)
            batch = self.client.get(self.id)
        return batch

    def _figures(self, batch: dict[str, Any]) -> dict[str, Any]:
        fig = self.client.figures(self.id)
        summary = self.client.summary()
        gate = summary["gate"]
        feeder = {k: v for k, v in (summary.get("feeder") or {}).items() if k not in ("samples", "problem")}
        for key, name in (("output_file_id", "batch-output.jsonl"), ("error_file_id", "batch-errors.jsonl")):
            (self.out / name).unlink(missing_ok=True)
            if batch.get(key):
                self.client.download(batch[key], self.out / name)
        ids = [json.loads(line)["custom_id"] for name in ("batch-output.jsonl", "batch-errors.jsonl")  # JSON Lines: "\n"
               if (self.out / name).exists() for line in (self.out / name).read_text().split("\n") if line]
        failed = dict(fig["failed"])
        cancelled = failed.pop("batch_cancelled", 0)
        gpu_s = gate["open_s"]
        return {"id": self.id, "status": batch["status"], "lines": batch["request_counts"]["total"],
                "completed": fig["completed"], "retried": fig["retried"], "failed": sum(failed.values()),
                "failed_by": failed, "not_sent": cancelled, "tokens": fig["tokens"], "tenant_gpu_s": gpu_s,
                # every line once in the output or the error file: none lost, none answered twice
                "lost": batch["request_counts"]["total"] - len(set(ids)), "twice": len(ids) - len(set(ids)),
                "lines_per_gpu_s": round(fig["completed"] / gpu_s, 3) if gpu_s else None,
                "tokens_per_gpu_s": round(fig["tokens"] / gpu_s, 3) if gpu_s else None, "feeder": feeder}


__all__ = ["DemoBatch", "write_input"]
