"""The validate experiment's table, for any of its runs: the demo solo and validating every 2nd version through a
policy tenant with IPC weight transfer, the same schedule each (``benchmarks/validate_h200.sh``)."""

from __future__ import annotations

import json
from typing import Callable

from readers.common import Run, _f


def rows(run: Run) -> str:
    """The summed-step ratio and the trainer's wait, then each version's validation."""
    solo, shared = (json.loads((run.data / f"{m}.json").read_text()) for m in ("solo", "validate"))
    ratio = sum(s["step_s"] for s in shared["steps_detail"]) / sum(s["step_s"] for s in solo["steps_detail"])
    v = shared["validation"]
    wait = shared["trainer_wait_ms"]
    lines = [f"Summed-step ratio (validating / solo, {len(solo['steps_detail'])} steps): **{ratio:.4f}**; the trainer's "
             f"wait for the GPU p50 {_f(wait['p50'], 1)} ms, max {_f(wait['max'], 1)} ms; validations reported late: "
             f"{len(v['late'])}.", "",
             "| version | status | answers | push s | seconds to validate | logged at step |", "|---|---|---|---|---|---|"]
    logged = {e["timeslice/validate/version"]: e["step"] for e in v["logged"]}
    for r in v["runs"]:
        lines.append(f"| {r['version']} | {r['status']} | {r['answers']} | {_f(r['push_s'], 3)} | {_f(r['seconds'], 3)} | "
                     f"{logged.get(r['version'], '–')} |")
    return "\n".join(lines)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
