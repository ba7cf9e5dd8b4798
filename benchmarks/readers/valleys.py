"""The valleys experiment's table, for any of its runs: the trainer's schedule solo and time-sliced beside a tenant.

Each time-sliced run is recomputed from its own timeline (``run.jsonl``) beside the solo run on the same schedule.
A run holds one ``valleys.json`` of ``benchmarks/valleys.py`` (solo and interleave) or several parts, one folder each
(``--out PART``), listed with their labels in the manifest's ``parts``.
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Callable

import valleys

from readers.common import Run
from timeslice_verl import analysis


def _single(run: Run) -> list[dict[str, Any]]:
    data = json.loads((run.data / "valleys.json").read_text())
    shared = analysis.summary(analysis.load(run.data / "interleave" / "run.jsonl"))
    for name in ("solo", "interleave"):
        data[name]["step_s_median"] = statistics.median(s["step_s"] for s in data[name]["steps_detail"])
    shared |= {k: data["interleave"][k] for k in ("step_s_median", "batch", "worker_data_intact", "steps_detail")}
    return [valleys.row(data["solo"], shared, "even", "park")]


def _parts(run: Run) -> list[dict[str, Any]]:
    out = []
    for part, label in run.manifest["parts"]:
        data = json.loads((run.data / part / "valleys.json").read_text())
        for r in data["runs"]:
            shared = analysis.summary(analysis.load(run.data / part / r["profile"] / r["mode"] / "run.jsonl"))
            shared |= {k: r["interleave"][k] for k in ("step_s_median", "batch", "worker_data_intact", "parked_gib_max",
                                                       "steps_detail", "swaps") if k in r["interleave"]}
            out.append(valleys.row(r["solo"], shared, label or r["profile"], r["mode"]))
    return out


def rows(run: Run) -> str:
    """Every time-sliced run beside its solo run: the trainer's steps and waits, the tenant's share, the valleys."""
    return valleys.table(_parts(run) if "parts" in run.manifest else _single(run))


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
