"""The cuda-cycles experiment's table, for any of its runs: freeze/thaw cycles of a torch worker through the agent
with the CUDA driver backend (``benchmarks/handoff.py --backend cuda``, ``gpu50.json``)."""

from __future__ import annotations

import json
import statistics
from typing import Callable

from readers.common import Run


def rows(run: Run) -> str:
    """Each step's median (min–max) over the cycles, the copy rates, and how many cycles kept the worker's data."""
    cycles = json.loads((run.data / "gpu50.json").read_text())["cycles"]

    def span(key: str, scale: float = 1.0, digits: int = 2) -> str:
        values = [c[key] * scale for c in cycles]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"

    def rate(key: str) -> str:
        values = [c["bytes"] / 1e9 / c[key] for c in cycles if c[key]]
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    intact = sum(bool(c["data_intact"]) for c in cycles)
    return "\n".join([
        "| step | median (min–max) | GB/s median (min–max) |",
        "|---|---|---|",
        f"| lock ms | {span('lock_s', 1e3)} | |",
        f"| checkpoint (GPU → host) s | {span('checkpoint_s')} | {rate('checkpoint_s')} |",
        f"| restore (host → GPU) s | {span('restore_s')} | {rate('restore_s')} |",
        f"| unlock ms | {span('unlock_s', 1e3)} | |",
        f"| cycles with the worker's data intact | {intact} of {len(cycles)} | |",
    ])


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
