"""The policy-push experiment's table, for any of its runs: the trainer process's weights pushed into a co-resident
vLLM through vLLM's IPC weight transfer, greedy answers compared (``benchmarks/policy_push.py``)."""

from __future__ import annotations

import json
from typing import Callable

from readers.common import Run, _f


def rows(run: Run) -> str:
    """Each push's time and size, then the checks on the answers."""
    got = json.loads((run.data / "policy_push.json").read_text())
    lines = ["| step | version | push s | tensors | GB |", "|---|---|---|---|---|"]
    for r in got["rows"]:
        lines.append(f"| {r['step']} | {r['version'] if r['version'] is not None else '–'} | {_f(r['push_s'], 3)} | "
                     f"{r['tensors'] or '–'} | {_f(r['gb'], 3)} |")
    checks = ", ".join(f"{k.replace('_', ' ')}: {'yes' if v else 'NO'}" for k, v in got["checks"].items())
    return "\n".join(lines) + f"\n\n{checks}."


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
