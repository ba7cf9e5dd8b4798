"""Which process a tenant is, and stopping exactly that one (the reclaim ladder's last step).

At registration the agent looks up the process that listens on the tenant URL's own address and port (the
socket's address must be the URL's, or a wildcard that covers it: a server on ``127.0.0.2:P`` or ``[::1]:P`` is
not the tenant at ``127.0.0.1:P``) and records it by pid and start time (:class:`TenantProcess`). The kill
stops only that recorded process — when it is still the same process, is tagged ``TIMESLICE_TENANT`` and
belongs to the agent's user (or the agent runs as root) — and what it started under the same user (vLLM's
engine core holds the GPU memory). Whatever listens on the port by the time of the kill is never taken for it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from dataclasses import dataclass

from timeslice_verl.agent import procfs
from timeslice_verl.log import get_logger

log = get_logger("agent")

TENANT_TAG_ENV = "TIMESLICE_TENANT"
"""Set (to any non-empty value) in the environment of a vLLM server the agent may kill at the ladder's last step."""

WILDCARDS = {"0.0.0.0": 4, "::": 6}


@dataclass(frozen=True)
class TenantProcess:
    """The process serving a tenant URL, as found at registration."""

    pid: int
    start: int
    """Start time in clock ticks (``/proc/<pid>/stat``): a recycled pid is never taken for it."""
    uid: int | None
    tagged: bool

    def describe(self) -> str:
        return f"pid {self.pid}" + ("" if self.tagged else f" (not tagged {TENANT_TAG_ENV})")


def _addresses(url: str) -> tuple[set[str], int | None]:
    """The IP addresses a URL's host names, and its port (the scheme's default when none is written)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        host = parts.hostname or ""
    except ValueError:
        return set(), None
    if port is None or not host:
        return set(), port
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except OSError:
        return set(), port
    return {_norm(info[4][0]) for info in infos}, port


def _norm(ip: str) -> str:
    """One spelling per address: ``::ffff:127.0.0.1`` is ``127.0.0.1``."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ip
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(mapped or addr)


def _covers(listen_ip: str, family: int, wanted: set[str]) -> int:
    """How well a listening address serves the URL: 2 exactly, 1 through a wildcard, 0 not at all."""
    ip = _norm(listen_ip)
    if ip in wanted:
        return 2
    if ip in WILDCARDS:
        v6 = WILDCARDS[ip] == 6
        for w in wanted:
            version = ipaddress.ip_address(w).version
            if version == 6 and v6 or version == 4 and (not v6 or family == socket.AF_INET6):
                return 1
    return 0


def find(url: str) -> tuple[TenantProcess | None, str]:
    """The process listening on ``url``'s own address and port, or None and why not."""
    import psutil

    wanted, port = _addresses(url)
    if port is None:
        return None, f"no port in {url!r}"
    if not wanted:
        return None, f"{url!r}: its host does not resolve"
    try:
        listeners = [c for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid]
    except (psutil.Error, OSError) as exc:
        return None, f"cannot list the listening sockets ({exc})"
    scored = sorted(((_covers(c.laddr.ip, c.family, wanted), c.pid) for c in listeners), reverse=True)
    scored = [(score, pid) for score, pid in scored if score]
    if not scored:
        return None, f"no process this agent can see listens on {url} (port {port} at {', '.join(sorted(wanted))})"
    best = scored[0][0]
    pids = sorted({pid for score, pid in scored if score == best})
    if len(pids) > 1:  # SO_REUSEPORT: several processes share the address; none is the tenant for sure
        return None, f"processes {pids} all listen on {url}: none is taken for the tenant"
    pid = pids[0]
    ident = procfs.identify(pid)
    if ident is None:
        return None, f"pid {pid} (listening on {url}) is gone"
    env = procfs.environ(pid) or {}
    return TenantProcess(pid=pid, start=ident.start, uid=procfs.uid_of(pid), tagged=bool(env.get(TENANT_TAG_ENV))), ""


def still_running(proc: TenantProcess | None) -> bool:
    """Whether ``proc`` is still the very process recorded (same pid, same start time)."""
    return proc is not None and procfs.identify(proc.pid) == procfs.ProcId(proc.pid, proc.start)


def rediscover(old: TenantProcess | None, url: str) -> tuple[TenantProcess | None, str]:
    """The tenant's process at a new registration: a restarted server is found anew, but while the process
    registered before still runs, whatever listens on its port now is not taken for it (a decoy that took the
    port over must never become what the kill stops in place of the tenant)."""
    found, note = find(url)
    if old is None or not still_running(old) or found == old:
        return found, note
    other = f"pid {found.pid}" if found else "no process"
    log.warning("tenant %s: %s listens there now, but pid %d registered as the tenant still runs: it stays the tenant",
                url, other, old.pid)
    return old, ""


def stoppable(proc: TenantProcess | None, why_unknown: str = "") -> tuple[list[int], str]:
    """The pids the kill may stop for ``proc`` (the server first, then what it started), and why none when empty."""
    import psutil

    if proc is None:
        return [], f"the tenant's process was not identified at registration ({why_unknown or 'unknown'})"
    if not still_running(proc):
        return [], f"pid {proc.pid} is no longer the process registered as the tenant (it exited)"
    env = procfs.environ(proc.pid) or {}
    if not env.get(TENANT_TAG_ENV):
        return [], f"pid {proc.pid} is not tagged {TENANT_TAG_ENV}"
    me = os.geteuid()
    owner = procfs.uid_of(proc.pid)
    if me != 0 and owner != me:
        return [], f"pid {proc.pid} belongs to uid {owner}, not to the agent's user"
    pids, refused = [proc.pid], []
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error as exc:
        return pids, f"its children are unknown ({type(exc).__name__})"
    for child in children:
        try:
            if child.uids().real == owner:
                pids.append(child.pid)
            else:
                refused.append(f"{child.pid} (another user's)")
        except psutil.Error as exc:
            refused.append(f"{child.pid} ({type(exc).__name__})")
    return pids, f"left alone: {', '.join(refused)}" if refused else ""


@dataclass(frozen=True)
class Killed:
    """What a kill did: the processes it signalled, those still alive after it, and why none was (when none was)."""

    pids: tuple[int, ...] = ()
    alive: tuple[int, ...] = ()
    why: str = ""

    @property
    def nothing_stopped(self) -> bool:
        return not self.pids

    def __str__(self) -> str:
        if not self.pids:
            return f"nothing stopped ({self.why})"
        return f"SIGKILL to {len(self.pids)} process(es) {list(self.pids)}" + (
            f", {len(self.alive)} still alive" if self.alive else "")


def kill(proc: TenantProcess | None, timeout_s: float, why_unknown: str = "") -> Killed:
    """SIGKILL the registered tenant process and what it started; wait up to ``timeout_s`` until they are gone."""
    import psutil

    pids, why = stoppable(proc, why_unknown)
    if not pids:
        log.error("tenant: nothing stopped: %s", why)
        return Killed(why=why)
    if why:
        log.warning("tenant pid %d: %s", pids[0], why)
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=max(0.1, timeout_s))
    log.error("tenant: SIGKILL sent to %s%s", pids, f"; still alive: {[p.pid for p in alive]}" if alive else "")
    return Killed(tuple(p.pid for p in procs), tuple(p.pid for p in alive))


__all__ = ["TENANT_TAG_ENV", "Killed", "TenantProcess", "find", "kill", "stoppable"]
