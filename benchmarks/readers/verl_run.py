"""The verl-run experiment's tables, for any of its runs; the parts and their labels in the manifest's ``parts``.

A run on two GPUs keeps one ``PART-timeline.jsonl`` per part (``rows``: the trainer's waits, freezes, bytes moved,
vLLM's share). A run on one GPU (manifest ``"gpus": 1``) keeps one folder per part as ``run.sh`` wrote it (``one_gpu``:
steps, the rollout's tokens/s with the tenant asleep and awake, the memory of every process on the GPU, validation)."""

from __future__ import annotations

from typing import Callable

from readers.common import Run, _f, _pct
from summarize import _records, brief, row, timeline_figures


def rows(run: Run) -> str:
    """One line per part, every figure from its ``PART-timeline.jsonl``."""
    lines = ["| run | steps | trainer wait s (median / max) | freezes | freeze s | thaw s | checkpointed GB "
             "| parked GB (park s / unpark s) | left on GPU GB | vLLM / run | vLLM / trainer idle | failed moves |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in run.manifest["parts"]:
        r = timeline_figures(_records(run.data / f"{name}-timeline.jsonl"))
        parked = "–" if r["parked_gb_median"] is None else \
            f"{_f(r['parked_gb_median'])} ({_f(r['park_s_median'], 3)} / {_f(r['unpark_s_median'], 3)})"
        lines.append(
            f"| {label} | {r['steps_in_timeline']} | {_f(r['trainer_wait_s_median'])} / {_f(r['trainer_wait_s_max'])} "
            f"| {r['freezes']} | {_f(r['freeze_s_median'], 3)} | {_f(r['thaw_s_median'], 3)} "
            f"| {_f(r['checkpointed_gb_median'])} | {parked} | {_f(r['left_gb_median'])} | {_pct(r['vllm_of_run'])} "
            f"| {_pct(r['vllm_of_idle'])} | {r['failed_transitions']} |")
    return "\n".join(lines)


def one_gpu(run: Run) -> str:
    """One line per figure, one column per part: what ``one_gpu.sh`` prints last, from the parts' folders."""
    parts = []
    for name, label in run.manifest["parts"]:
        part = row(run.data / name)
        part["mode"] = label
        parts.append(part)
    return brief(parts)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"one_gpu": one_gpu} if run.manifest.get("gpus") == 1 else {"rows": rows}
