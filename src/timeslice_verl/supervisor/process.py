"""The tenant's processes as one unit: started in a session of their own, tagged with the supervisor they belong
to, bound to the supervisor's life, and stopped together.

vLLM runs an engine core process beside its API server; either may outlive the other. So the supervisor never
signals only the process it started: every process of this user whose environment carries its tag
(``TIMESLICE_TENANT_SUPERVISOR``, the server's address) is the tenant — also the orphans a killed supervisor left,
which the next one stops before it starts its own. Nothing else is touched: not another user's process, not an
untagged one, not one tagged for another address.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Iterable

import psutil

from timeslice_verl.log import get_logger
from timeslice_verl.private import create_private

log = get_logger("tenant")

OWNER_ENV = "TIMESLICE_TENANT_SUPERVISOR"
"""In the environment of every process of a supervised tenant: the server's address (one server per address)."""
PR_SET_PDEATHSIG = 1


def _bind_to_parent() -> None:
    """In the child, before exec: SIGTERM it when the supervisor dies (a SIGKILLed supervisor leaves no tenant)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the supervisor died between fork and prctl
        os._exit(1)


def spawn(argv: list[str], env: dict[str, str], tag: str) -> subprocess.Popen:
    """Start the tenant in a session (and process group) of its own, tagged ``tag``, bound to this process."""
    return subprocess.Popen(argv, env={**env, OWNER_ENV: tag}, start_new_session=True, preexec_fn=_bind_to_parent)


def tagged(tag: str) -> list[psutil.Process]:
    """This user's processes carrying ``tag`` (the tenant of one address), this process excluded."""
    me, uid, found = os.getpid(), os.getuid(), []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if proc.environ().get(OWNER_ENV) == tag:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stop_all(procs: Iterable[psutil.Process], grace_s: float, why: str) -> int:
    """SIGTERM each, SIGKILL what is left after ``grace_s``; how many were running."""
    procs = [p for p in procs if _alive(p)]
    for p in procs:
        _signal(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        log.warning("tenant: pid %d did not stop within %.0f s of SIGTERM (%s): SIGKILL", p.pid, grace_s, why)
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=10)
    return len(procs)


def stop_tenant(tag: str, grace_s: float, why: str) -> int:
    """Stop every process of the tenant tagged ``tag`` (its server, the engine core, orphans of an earlier run)."""
    deadline = time.monotonic() + grace_s
    stopped = 0
    for _ in range(3):  # a process may start a child while we stop it: look again
        procs = tagged(tag)
        if not procs:
            break
        stopped += stop_all(procs, max(0.5, deadline - time.monotonic()), why)
    return stopped


def listeners(port: int) -> set[int]:
    """Pids listening on TCP ``port`` that this user may see (empty: none, or none visible)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return set()
    return {c.pid for c in conns if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def tree(pid: int) -> set[int]:
    """``pid`` and its descendants now."""
    try:
        root = psutil.Process(pid)
        return {pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.Error:
        return set()


class Taken(RuntimeError):
    """Another supervisor runs the tenant of this address."""


def hold_lock(path: Path) -> IO[bytes]:
    """Take the supervisor's lock of one address (released when the process ends, however it ends)."""
    create_private(path, "the tenant supervisor's lock")
    f = open(path, "rb")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise Taken(f"another supervisor runs this tenant (it holds {path}): stop it first") from None
    return f


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


__all__ = ["OWNER_ENV", "Taken", "hold_lock", "listeners", "spawn", "stop_all", "stop_tenant", "tagged", "tree"]
