"""What the arbiter shows and keeps: the GPU's owner, the ``status`` snapshot, the state file write."""

from __future__ import annotations

import time
from typing import Any

from timeslice_verl.agent.state import RUNNING
from timeslice_verl.agent.tenant import AWAKE
from timeslice_verl.log import get_logger

log = get_logger("agent")


class SnapshotMixin:
    """Mixed into :class:`~timeslice_verl.agent.arbiter.Arbiter`, whose state it reads."""

    def owner(self) -> str:
        for job in self.jobs.values():
            if job.holding and job.state == RUNNING:
                return f"job:{job.name}"
        if self.tenant_rec and self.tenant_rec.state == AWAKE:
            return "tenant"
        if self.current:
            return "transitioning"
        for job in self.jobs.values():
            if job.state == RUNNING and job.pids():
                return f"job:{job.name}"
        return "none"

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        jobs = []
        for job in self.jobs.values():
            d = job.to_dict()
            d["pids"] = job.pids()
            d["attached"] = job.attached is not None
            d["prepared"] = job.prepared_until > now
            d["queued"] = job.name in self.queue
            d["refused"] = job.refused
            del d["procs"], d["registered"]
            jobs.append(d)
        snap: dict[str, Any] = {
            "owner": self.owner(),
            "transition": self.current,
            "waiting_for": self.tenant.waiting_for() if self.tenant is not None else "",
            "queue": list(self.queue),
            "jobs": jobs,
            "tenant": self.tenant_rec.to_dict() if self.tenant_rec else None,
            "ladder": {"deadline_s": self.reclaim_deadline_s, **self.ladder_counts, "last": self.ladder_last},
            "transitions": self.seq,
        }
        if self.probe is not None:
            mem = self.probe.memory()
            snap["gpu"] = {"total": mem.total, "used": mem.used, "free": mem.free, "driver": self.probe.driver_version}
        return snap

    def _persist(self) -> None:
        try:
            self.store.save(self.jobs, self.tenant_rec, {"queue": list(self.queue)})
        except OSError as exc:  # pragma: no cover - disk full etc.
            log.error("could not write state file %s: %s", self.store.path, exc)

