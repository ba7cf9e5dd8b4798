"""The cluster-queue experiment's table, for any of its runs: one PostgreSQL queue, feeders each beside a stand-in of
known capacity (``benchmarks/cluster_queue.py``, ``cluster-queue.json``)."""

from __future__ import annotations

import json
from typing import Callable

from readers.common import Run


def rows(run: Run) -> str:
    """Lines per second against the tenants' capacity, and the CPU each part spends per line, by number of feeders."""
    got = json.loads((run.data / "cluster-queue.json").read_text())["rows"]
    lines = ["| feeders | lines/s | tenants' capacity, lines/s | vs capacity | CPU ms per line: feeders / API / database |",
             "|---|---|---|---|---|"]
    for r in got:
        lines.append(f"| {r['feeders']} | {r['lines_per_s']:.1f} | {r['capacity_lines_per_s']:.0f} | {r['vs_capacity']:.3f} | "
                     f"{r['cpu_ms_per_line_feeders']:.2f} / {r['cpu_ms_per_line_api']:.2f} / "
                     f"{r['cpu_ms_per_line_database']:.2f} |")
    return "\n".join(lines)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
