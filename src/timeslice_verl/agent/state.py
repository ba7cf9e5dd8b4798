"""The agent's state machine records and their persistence.

A job is RUNNING (its processes are on the GPU), TRANSITIONING (being frozen or thawed), FROZEN
(frozen: GPU memory parked in host RAM) or FAULTED (a transition failed; ``fault`` says why). The
file is rewritten atomically after every change, so an agent restarted after a crash knows which
processes it froze and can ask the driver what state they are really in before serving requests.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timeslice_verl.agent.procfs import ProcId
from timeslice_verl.log import get_logger

log = get_logger("agent.state")

from timeslice_verl.agent.policy import FAULTED, FROZEN, RUNNING, TRANSITIONING  # noqa: E402,F401  (one definition)

LEGACY_STATES = {"SAVED": FROZEN}
"""State names of earlier versions, read from old state files."""
STATE_VERSION = 1


@dataclass
class Job:
    name: str
    state: str = RUNNING
    procs: list[ProcId] = field(default_factory=list)
    """The processes frozen/thawed last (discovered by tag or registered)."""
    registered: list[ProcId] = field(default_factory=list)
    saved_bytes: int = 0
    fault: str = ""
    holding: bool = False
    """Granted and not released. Survives an agent restart (the client may still be training)."""
    last_freeze_s: float = 0.0
    last_restore_s: float = 0.0
    direction: str = ""
    """While TRANSITIONING: ``freeze`` or ``thaw``."""
    # not persisted
    owner_uid: int | None = None
    """The uid of the job's client (its tagged processes must be that user's)."""
    orphaned_at: float = 0.0
    """Since when a holder recorded before a restart has had no client (0: attached or not holding)."""
    busy: bool = False
    """A freeze or thaw of it is under way (discovery included): the watchdog leaves it alone."""
    ending: bool = False
    """The client said the job has ended (release with ``done``): forget it, never freeze it."""
    refused: str = ""
    """Why the last freeze was refused (nothing touched); no new freeze until the job's next release."""
    attached: int | None = None
    prepared_until: float = 0.0
    cursor: int = 0

    def pids(self) -> list[int]:
        return sorted({p.pid for p in self.procs} | {p.pid for p in self.registered})

    def pids_known(self) -> bool:
        return bool(self.procs or self.registered)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "procs": [p.to_dict() for p in self.procs],
            "registered": [p.to_dict() for p in self.registered],
            "saved_bytes": self.saved_bytes,
            "fault": self.fault,
            "holding": self.holding,
            "last_freeze_s": self.last_freeze_s,
            "last_restore_s": self.last_restore_s,
            "direction": self.direction,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        return cls(
            name=str(data["name"]),
            state=LEGACY_STATES.get(str(data.get("state", RUNNING)), str(data.get("state", RUNNING))),
            procs=[ProcId(int(p["pid"]), int(p["start"])) for p in data.get("procs", [])],
            registered=[ProcId(int(p["pid"]), int(p["start"])) for p in data.get("registered", [])],
            saved_bytes=int(data.get("saved_bytes", 0)),
            fault=str(data.get("fault", "")),
            holding=bool(data.get("holding", False)),
            last_freeze_s=float(data.get("last_freeze_s", 0.0)),
            last_restore_s=float(data.get("last_restore_s", 0.0)),
            direction=str(data.get("direction", "")),
        )


@dataclass
class TenantRecord:
    url: str = ""
    state: str = ""
    """``awake``, ``asleep``, ``dead`` or ``faulted``; empty when none is registered."""
    version: str = ""
    sleep_level: int = 1
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.state, "version": self.version, "sleep_level": self.sleep_level, "error": self.error}


class StateStore:
    """Atomic JSON persistence of jobs and tenant (write to a temp file, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> tuple[dict[str, Job], TenantRecord | None, dict[str, Any]]:
        if not self.path.exists():
            return {}, None, {}
        try:
            data = json.loads(self.path.read_text())
            jobs = {j["name"]: Job.from_dict(j) for j in data.get("jobs", [])}
            tenant_data = data.get("tenant") or None
            tenant = TenantRecord(**tenant_data) if tenant_data and tenant_data.get("url") else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            broken = self.path.with_suffix(f".broken-{int(time.time())}")
            log.error("state file %s is unreadable (%s); moved aside to %s", self.path, exc, broken)
            os.replace(self.path, broken)
            return {}, None, {}
        return jobs, tenant, data

    def save(self, jobs: dict[str, Job], tenant: TenantRecord | None, extra: dict[str, Any]) -> None:
        data = {
            "version": STATE_VERSION,
            "written": time.time(),
            "jobs": [j.to_dict() for j in jobs.values()],
            "tenant": tenant.to_dict() if tenant else None,
            **extra,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".state-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
