"""The wedge experiment's table, for any of its runs: a tenant SIGSTOPped in a valley, the reclaim ladder's kill, its
supervisor bringing it back, and what the batch lost (``timeslice-verl demo --wedge-at N``, ``summary.json``)."""

from __future__ import annotations

import json
from typing import Callable

from readers.common import Run, _f


def rows(run: Run) -> str:
    """The stop, the trainer's acquire, and the batch's lines."""
    got = json.loads((run.data / "summary.json").read_text())
    stop, batch = got["tenant_stop"], got["batch"]
    return "\n".join([
        "| stopped before the reclaim s | trainer's acquire s | reclaim | batch lines answered | sent again | failed | "
        "lost | twice |", "|---|---|---|---|---|---|---|---|",
        f"| {_f(stop['stopped_before_reclaim_s'])} | {_f(stop['trainer_wait_s'], 3)} | "
        f"{stop['reclaim'].split(':')[1].strip()} | {batch['completed']} of {batch['lines']} | {batch['retried']} | "
        f"{batch['failed']} | {batch['lost']} | {batch['twice']} |"])


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
