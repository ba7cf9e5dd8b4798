"""What the agent reads about processes from ``/proc``: tags, owners, identity, liveness.

The agent only ever touches processes tagged for one of its jobs (``TIMESLICE_JOB=<job>`` in
``/proc/<pid>/environ``) or registered explicitly by a client of the same user. A process is
identified by ``(pid, start time)`` so a recycled PID is never mistaken for a job's process.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from timeslice_verl.names import JOB_TAG_ENV, SCOPE_ENV

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcId:
    pid: int
    start: int
    """Start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``)."""

    def to_dict(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}


class ProcUnreadable(OSError):
    """``/proc`` could not be read (out of file descriptors or memory…): no sign the process exited."""


_GONE = (errno.ENOENT, errno.ESRCH)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise ProcUnreadable(exc.errno, f"cannot read /proc/{pid}/stat: {exc.strerror}") from exc
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest  # rest[0] is field 3 (state)


def state_char(pid: int) -> str | None:
    """Kernel state letter (R, S, T, Z…) or None when the process is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def identify(pid: int) -> ProcId | None:
    start = start_time(pid)
    return ProcId(pid, start) if start is not None else None


def alive(proc: ProcId) -> bool:
    """Still the same process (and not a zombie)."""
    state = state_char(proc.pid)
    return state is not None and state not in ("Z", "X") and start_time(proc.pid) == proc.start


def uid_of(pid: int) -> int | None:
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def is_thread_group_leader(pid: int) -> bool:
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1]) == pid
    except (OSError, ValueError, IndexError):
        return False
    return False


def job_tag(pid: int) -> str | None:
    """The process's ``TIMESLICE_JOB`` value, or None (untagged, gone, or not readable by us)."""
    try:
        environ = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = JOB_TAG_ENV.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def title(pid: int) -> str:
    """The process's command line as ``ps`` shows it (Ray and vLLM write their titles there: ``ray::WorkerDict``,
    ``VLLM::EngineCore``), or "" (gone or not readable by us)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def environ(pid: int) -> dict[str, str] | None:
    """The process's initial environment, or None (gone or not readable by us)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    out = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def mapped_files(pid: int) -> set[str] | None:
    """Paths of the files mapped into the process (shared libraries included), or None."""
    try:
        lines = (PROC / str(pid) / "maps").read_text(errors="replace").splitlines()
    except OSError:
        return None
    return {parts[5] for parts in (line.split(maxsplit=5) for line in lines) if len(parts) == 6 and parts[5].startswith("/")}


P2P_OFF = ("1", "true", "yes", "on")


def nccl_p2p_hazard(pid: int) -> str | None:
    """Why a CUDA driver checkpoint of ``pid`` might not be restorable, or None.

    A live NCCL communicator whose peer-to-peer transport maps another process's GPU memory makes
    ``cuCheckpointProcessRestore`` fail (CUDA_ERROR_OPERATING_SYSTEM), leaving the process
    checkpointed for good. Which communicators a process holds cannot be read from outside, so any
    process that has NCCL loaded must have the P2P transport off (``NCCL_P2P_DISABLE=1`` in its
    environment) before the agent checkpoints it.
    """
    files = mapped_files(pid)
    if not files or not any("libnccl" in os.path.basename(f) for f in files):
        return None
    env = environ(pid) or {}
    if env.get("NCCL_P2P_DISABLE", "").strip().lower() in P2P_OFF:
        return None
    return (
        f"pid {pid} has NCCL loaded with its peer-to-peer transport on: the CUDA driver cannot restore a "
        "process whose communicator maps another GPU's memory (restore fails with error 304 and the "
        "process stays checkpointed). Set NCCL_P2P_DISABLE=1 for the job's processes (the interleave "
        'option does: ray_kwargs.ray_init.runtime_env.env_vars.NCCL_P2P_DISABLE="1")'
    )


def tagged_processes(job: str) -> list[int]:
    """Thread-group leaders (every process we can read) tagged ``job`` in this process's scope (``TIMESLICE_SCOPE``)."""
    candidates = [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    me, scope = os.getpid(), os.environ.get(SCOPE_ENV)
    return sorted(p for p in set(candidates) if p != me and is_thread_group_leader(p) and job_tag(p) == job
                  and (environ(p) or {}).get(SCOPE_ENV) == scope)
