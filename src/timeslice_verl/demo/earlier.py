"""A demo's folder holds one run: the run before it is moved into ``earlier/<when it ended, UTC>/`` first, whole — a
user may still want its timeline, summary and logs, so nothing a run wrote is ever deleted by the next one."""

from __future__ import annotations

import os
import time
from pathlib import Path

from timeslice_verl.log import get_logger

log = get_logger("demo")

RUN_FILES = ("run.jsonl", "timeline.png", "summary.json", "agent.log", "tenant.log", "policy-tenant.log", "batch.log",
             "worker.log", "val.parquet", "batch-input.jsonl", "batch-output.jsonl", "batch-errors.jsonl", "batch-state")
"""What a run writes into its folder (``run/``, its sockets and the agent's state, is made anew by each run)."""
EARLIER = "earlier"


def set_aside(out: Path) -> Path | None:
    """Move the run ``out`` holds (if any) into ``out/earlier/<YYYYmmddTHHMMSSZ>/``; that folder, else None."""
    found = [out / name for name in RUN_FILES if (out / name).exists()] + sorted(out.glob("batch.sqlite*"))
    if not found:
        return None
    ended = max(path.stat().st_mtime for path in found)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(ended))
    folder, n = out / EARLIER / stamp, 1
    while folder.exists():  # two runs that ended in the same second
        n += 1
        folder = out / EARLIER / f"{stamp}-{n}"
    folder.mkdir(parents=True)
    for path in found:
        os.replace(path, folder / path.name)
    log.info("demo: the run %s held before is in %s now", out, folder)
    return folder


__all__ = ["EARLIER", "RUN_FILES", "set_aside"]
