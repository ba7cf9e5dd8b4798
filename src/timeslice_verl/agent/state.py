"""The agent's state machine records and their persistence.

A job is RUNNING (its processes are on the GPU), TRANSITIONING (being frozen or thawed), FROZEN
(frozen: GPU memory held in host RAM) or FAULTED (a transition failed; ``fault`` says why). The
file is rewritten atomically after every change, so an agent restarted after a crash knows which
processes it froze and can ask the driver what state they are really in before serving requests.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timeslice_verl.agent.procfs import ProcId
from timeslice_verl.agent.client.protocol import url_parts_ok
from timeslice_verl.names import SWAP_MODES, SwapMode, valid_job, valid_urls
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
    frozen_bytes: int = 0
    fault: str = ""
    holding: bool = False
    """Granted and not released. Survives an agent restart (the client may still be training)."""
    last_freeze_s: float = 0.0
    last_thaw_s: float = 0.0
    direction: str = ""
    """While TRANSITIONING: ``freeze`` or ``thaw``."""
    swap: SwapMode = SwapMode.checkpoint
    """How its last release asked the memory to leave: ``checkpoint``, ``park`` (only lock: the workers
    parked their tensors) or ``park+checkpoint``."""
    parked_bytes: int = 0
    """What its workers parked in host RAM at the last release (they need it back on the GPU after a thaw)."""
    parked: dict[int, int] = field(default_factory=dict)
    """pid → bytes each worker reported keeping on the GPU after its park (the footprint check's limits): an agent
    restarted mid-valley freezes the job again by them (without them, a resident trainer read as one that kept
    nothing, and the freeze was refused)."""
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "procs": [p.to_dict() for p in self.procs],
            "registered": [p.to_dict() for p in self.registered],
            "frozen_bytes": self.frozen_bytes,
            "fault": self.fault,
            "holding": self.holding,
            "last_freeze_s": self.last_freeze_s,
            "last_thaw_s": self.last_thaw_s,
            "direction": self.direction,
            "swap": self.swap,
            "parked_bytes": self.parked_bytes,
            "kept": [{"pid": pid, "kept": kept} for pid, kept in sorted(self.parked.items())],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        return cls(
            name=str(data["name"]),
            state=LEGACY_STATES.get(str(data.get("state", RUNNING)), str(data.get("state", RUNNING))),
            procs=[ProcId(int(p["pid"]), int(p["start"])) for p in data.get("procs", [])],
            registered=[ProcId(int(p["pid"]), int(p["start"])) for p in data.get("registered", [])],
            frozen_bytes=int(data.get("frozen_bytes", data.get("saved_bytes", 0))),  # saved_bytes: before 0.2
            fault=str(data.get("fault", "")),
            holding=bool(data.get("holding", False)),
            last_freeze_s=float(data.get("last_freeze_s", 0.0)),
            last_thaw_s=float(data.get("last_thaw_s", data.get("last_restore_s", 0.0))),  # last_restore_s: before 0.2
            direction=str(data.get("direction", "")),
            swap=SwapMode(data.get("swap", SwapMode.checkpoint)),
            parked_bytes=int(data.get("parked_bytes", 0)),
            parked={int(r["pid"]): int(r["kept"]) for r in data.get("kept", [])},
        )


@dataclass
class TenantRecord:
    urls: list[str] = field(default_factory=list)
    """The tenant's addresses (one vLLM per GPU); empty when none is registered."""
    state: str = ""
    """``awake``, ``asleep``, ``dead`` or ``faulted``; empty when none is registered."""
    version: str = ""
    sleep_level: int = 1
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"urls": list(self.urls), "state": self.state, "version": self.version, "sleep_level": self.sleep_level, "error": self.error}


class StateError(ValueError):
    """The state file does not say what this version of the agent writes."""


_NAME_RE = re.compile(rb'"name"\s*:\s*"([A-Za-z0-9][A-Za-z0-9._-]{0,63})"')
_PROC_RE = re.compile(rb'\{\s*"pid"\s*:\s*(\d{1,10})\s*,\s*"start"\s*:\s*(\d{1,20})\s*\}')
_JOB_STATES = {RUNNING, TRANSITIONING, FROZEN, FAULTED, *LEGACY_STATES}
_TENANT_STATES = {"", "awake", "asleep", "dead", "faulted"}


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise StateError(what)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _recorded_urls(tenant_data: dict[str, Any]) -> list[str]:
    """The tenant's addresses in a state file: ``urls``; a file written before they were a list has ``url`` (one
    server, or several joined by commas — read once here, written back as a list)."""
    if "urls" in tenant_data:
        _need(isinstance(tenant_data["urls"], list), "tenant urls is not a list")
        return list(tenant_data["urls"])
    old = tenant_data.get("url", "")
    _need(isinstance(old, str), "tenant url is not a string")
    return [u for u in old.split(",") if u] if old else []  # legacy-state: the one reader of the joined form


def _validate(data: Any) -> tuple[dict[str, Job], TenantRecord | None]:
    """Jobs and tenant from a parsed state file, or :class:`StateError` naming what is wrong."""
    _need(isinstance(data, dict), f"top level is {type(data).__name__}, not an object")
    _need(_int(data.get("version")) and data["version"] == STATE_VERSION, f"version {data.get('version')!r} is not {STATE_VERSION}")
    _need(isinstance(data.get("jobs", []), list), "jobs is not a list")
    jobs: dict[str, Job] = {}
    for entry in data.get("jobs", []):
        _need(isinstance(entry, dict) and valid_job(entry.get("name")), f"a job entry is not a named job: {str(entry)[:80]}")
        _need(entry.get("state", RUNNING) in _JOB_STATES, f"job {entry['name']}: unknown state {entry.get('state')!r}")
        for key in ("procs", "registered"):
            procs = entry.get(key, [])
            _need(isinstance(procs, list) and all(isinstance(p, dict) and _int(p.get("pid")) and p["pid"] > 1
                                                  and _int(p.get("start")) and p["start"] >= 0 for p in procs),
                  f"job {entry['name']}: {key} is not a list of (pid, start)")
        _need(isinstance(entry.get("holding", False), bool), f"job {entry['name']}: holding is not true/false")
        _need(entry.get("swap", SwapMode.checkpoint) in SWAP_MODES, f"job {entry['name']}: unknown swap {entry.get('swap')!r}")
        _need(_int(entry.get("parked_bytes", 0)) and entry.get("parked_bytes", 0) >= 0, f"job {entry['name']}: parked_bytes is not a byte count")
        kept = entry.get("kept", [])
        _need(isinstance(kept, list) and all(isinstance(r, dict) and _int(r.get("pid")) and r["pid"] > 1
                                             and _int(r.get("kept")) and r["kept"] >= 0 for r in kept),
              f"job {entry['name']}: kept is not a list of (pid, bytes kept)")
        jobs[entry["name"]] = Job.from_dict(entry)
    tenant_data = data.get("tenant")
    tenant = None
    if tenant_data is not None:
        _need(isinstance(tenant_data, dict), "tenant is not an object")
        urls = _recorded_urls(tenant_data)
        _need(urls == [] or (valid_urls(urls) and all(url_parts_ok(u) for u in urls)),
              f"tenant urls {str(urls)[:80]} are not http(s) URLs")
        _need(tenant_data.get("state", "") in _TENANT_STATES, f"tenant state {tenant_data.get('state')!r} is unknown")
        _need(tenant_data.get("sleep_level", 1) in (1, 2) and _int(tenant_data.get("sleep_level", 1)), "tenant sleep_level is not 1 or 2")
        known = {k: str(tenant_data[k]) for k in ("state", "version", "error") if k in tenant_data}
        tenant = TenantRecord(urls=urls, sleep_level=tenant_data.get("sleep_level", 1), **known) if urls else None
    return jobs, tenant


class StateStore:
    """Atomic JSON persistence of jobs and tenant (write to a temp file, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cond = threading.Condition()
        self._pending: bytes | None = None
        self._writing = False
        self._closing = False
        self._thread: threading.Thread | None = None

    def load(self) -> tuple[dict[str, Job], TenantRecord | None, dict[str, Any]]:
        """The recorded jobs and tenant. A file that does not validate is moved aside (never deleted);
        the job names and the processes (pid and start time) still legible in it are returned as
        ``extra["salvaged_jobs"]`` and ``extra["salvaged_procs"]`` so the agent can
        thaw those jobs' processes instead of forgetting them frozen."""
        if not self.path.exists():
            return {}, None, {}
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            return self._quarantine(b"", f"cannot read it: {exc}")
        try:
            data = json.loads(raw)
            jobs, tenant = _validate(data)
        except (ValueError, KeyError, TypeError, RecursionError, StateError) as exc:
            return self._quarantine(raw, str(exc)[:300])
        return jobs, tenant, data

    def _quarantine(self, raw: bytes, why: str) -> tuple[dict[str, Job], TenantRecord | None, dict[str, Any]]:
        broken = self.path.with_name(f"{self.path.name}.broken-{int(time.time())}")
        names = sorted({m.decode() for m in _NAME_RE.findall(raw) if valid_job(m.decode(errors="replace"))})
        procs = sorted({(int(p), int(s)) for p, s in _PROC_RE.findall(raw) if 1 < int(p) < 2**31})
        log.error("state file %s is invalid (%s); moved aside to %s; jobs named in it: %s", self.path, why, broken,
                  ", ".join(names) or "none")
        try:
            os.replace(self.path, broken)
        except OSError as exc:  # pragma: no cover - read-only directory
            log.error("could not move %s aside: %s", self.path, exc)
        return {}, None, {"salvaged_jobs": names, "salvaged_procs": [ProcId(p, s) for p, s in procs]}

    def save(self, jobs: dict[str, Job], tenant: TenantRecord | None, extra: dict[str, Any]) -> None:
        """Record the state. Serialised here (a consistent snapshot); written, fsync'd and renamed by the
        writer thread once it runs (never on the agent's event loop), else at once."""
        data = json.dumps({
            "version": STATE_VERSION,
            "written": time.time(),
            "jobs": [j.to_dict() for j in jobs.values()],
            "tenant": tenant.to_dict() if tenant else None,
            **extra,
        }, indent=1).encode()
        if self._thread is None:
            self._write(data)
            return
        with self._cond:
            self._pending = data
            self._cond.notify_all()

    def start_writer(self) -> None:
        """Write from a thread of its own from now on: the newest state wins, a failed write (out of file
        descriptors, disk full) is retried until it lands, its error logged at most every 10 s."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="timeslice-state", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is pending and stop the writer (the agent's shutdown)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._pending is not None:  # the writer could not: one last try here
            data, self._pending = self._pending, None
            self._write(data)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the newest state is on disk; False if it is not within ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._writing, timeout_s)

    def _writer(self) -> None:
        last_error = 0.0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    return
                data, self._pending, self._writing = self._pending, None, True
            try:
                self._write(data)
            except OSError as exc:
                if time.monotonic() - last_error > 10:
                    log.error("could not write state file %s: %s (retrying until it lands)", self.path, exc)
                    last_error = time.monotonic()
                with self._cond:
                    if self._pending is None:
                        self._pending = data  # nothing newer came: this one is still the state to write
                    self._writing = False
                    self._cond.notify_all()
                    if self._closing:
                        return
                    self._cond.wait(0.5)
                continue
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def _write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".state-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
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
