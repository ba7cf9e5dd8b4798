"""The ladder experiment's table, for any of its runs: the trainer's acquire against the reclaim deadline while the
tenant misbehaves (``benchmarks/ladder.py``; ``ladder.json`` with the stand-in, ``ladder-vllm.json`` with a real vLLM,
whose run also counts the batch requests of its ``vllm-keep`` cycles)."""

from __future__ import annotations

import json
from typing import Callable

import ladder

from readers.common import Run


def rows(run: Run) -> str:
    """Each scenario's acquire against the deadline."""
    path = run.data / "ladder.json"
    if path.exists():
        data = json.loads(path.read_text())
        return ladder.table(data["rows"], data["deadline_s"])
    data = json.loads((run.data / "ladder-vllm.json").read_text())
    keep = [r for r in data["rows"] if r["scenario"] == "vllm-keep"]
    return (ladder.table(data["rows"], data["deadline_s"]) + "\n\n"
            f"Batch requests during the `vllm-keep` cycles: {keep[0]['requests_ok']} completed, "
            f"{keep[0]['requests_failed']} failed.")


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
