"""The swap experiment's tables, for any of its runs: every swap mode beside a real vLLM tenant.

A one-GPU run (``benchmarks/swap_run.sh one``) has one ``rows.json``; a multi-GPU run (``swap_run.sh two``) one folder
per part, listed with their labels in the manifest's ``parts``, and ``side-by-side``: what checkpointing a job's
ranks at once gains, from its two 1 s parts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from readers.common import Run


def _rows(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "rows.json").read_text())


def one_gpu(run: Run) -> str:
    """Every swap mode, with and without prepare: the trainer's wait, the bytes moved, the step against solo."""
    lines = ["| swap | prepare | trainer wait at acquire s (median) | out s | back s | moved GB | left on GPU GB "
             "| step / solo | vLLM serving / trainer idle | failed requests |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in _rows(run.data):
        lines.append(f"| {r['mode']} | {'yes' if r['prepare'] else 'no'} | {r['p1_med']:.3f} | {r['out_s']:.3f} "
                     f"| {r['back_s']:.3f} | {r['moved_gb']:.2f} | {r['left_gb']:.2f} | {r['p4']:.3f} | {r['p5']:.2f} "
                     f"| {r['p6']} |")
    return "\n".join(lines)


def ranks(run: Run) -> str:
    """20 handoffs per mode and part, medians, bytes per rank; whether every rank's losses match a solo run's."""
    lines = ["| swap | valleys · agent | trainer wait at acquire s | out s | back s | moved GB | left on GPU GB "
             "| vLLM serving / trainer idle | completions | bit-identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for part, label in run.manifest["parts"]:
        for r in _rows(run.data / part):
            lines.append(f"| {r['mode']} | {label} | {r['p1_med']:.3f} | {r['out_s']:.3f} | {r['back_s']:.3f} "
                         f"| {r['moved_gb']:.2f} | {r['left_gb']:.2f} | {r['p5']:.3f} | {r['served']} "
                         f"| {'yes' if r['bit_identical'] and r['losses_as_solo'] else 'NO'} |")
    return "\n".join(lines)


def side_by_side(run: Run) -> str:
    """How much issuing a job's checkpoints at once gains, from the medians of the two 1 s parts."""
    one = {r["mode"]: r for r in _rows(run.data / "valley-1s")}["checkpoint"]
    two = {r["mode"]: r for r in _rows(run.data / "valley-1s-concurrent")}["checkpoint"]
    return (f"checkpoint of two ranks one after the other {one['out_s']:.2f} s, side by side {two['out_s']:.2f} s "
            f"({one['out_s'] / two['out_s']:.2f}×); restore {one['back_s']:.2f} s vs {two['back_s']:.2f} s "
            f"({one['back_s'] / two['back_s']:.2f}×); medians of 19 handoffs each, two runs minutes apart")


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    if "parts" in run.manifest:
        return {"ranks": ranks, "side-by-side": side_by_side}
    return {"rows": one_gpu}
