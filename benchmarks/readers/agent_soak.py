"""The agent-soak experiment's tables, for any of its runs: a real agent (CPU ``sigstop`` backend) with the stand-in
vLLM as its tenant, through many handoffs and under many clients at once (``benchmarks/agent_soak.py``,
``soak.json``)."""

from __future__ import annotations

import json
from typing import Any, Callable

from readers.common import Run


def _n(count: int) -> str:
    """``1 000``: thousands set apart by a space, as the documents write them."""
    return f"{count:,}".replace(",", " ")


def _data(run: Run) -> dict[str, Any]:
    return json.loads((run.data / "soak.json").read_text())


def soak(run: Run) -> str:
    """One job's acquire/release cycles, each a thaw and a freeze of a tagged worker plus a tenant yield and reclaim:
    the agent's open fds, threads and memory before and after (drift is what a leak would show)."""
    s = _data(run)["soak"]
    return "\n".join([
        "| cycles | seconds | agent's open fds | threads | RSS MiB |", "|---|---|---|---|---|",
        f"| {_n(s['cycles'])} | {s['seconds']:.1f} | {s['fds_before']} → {s['fds_after']} | "
        f"{s['threads_before']} → {s['threads_after']} | {s['rss_kib_before'] / 1024:.1f} → "
        f"{s['rss_kib_after'] / 1024:.1f} |"])


def load(run: Run) -> str:
    """Many clients at once, each with its own job on one exclusive GPU: an acquire waits for the handoffs queued
    before it (first come, first served), so its latency grows with the clients."""
    data = _data(run)
    lines = ["| clients | acquires | errors | acquire p50 | acquire p99 |", "|---|---|---|---|---|"]
    for r in data["load"]:
        lines.append(f"| {r['clients']} | {_n(r['acquires'])} | {r['errors']} | {r['p50_ms'] / 1e3:.2f} s | "
                     f"{r['p99_ms'] / 1e3:.2f} s |")
    return "\n".join(lines) + f"\n\nThe agent's exit code after SIGTERM: {data['agent_exit']}."


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"soak": soak, "load": load}
