"""The reclaim ladder: how the agent gets the GPU back from a tenant within a deadline, whatever it does.

A yield climbs down at most three steps, each bounded so the whole stays within
``tenant.reclaim_deadline_s`` (:func:`budgets`):

1. **polite** — ``/pause`` (``keep`` or ``wait``) then ``/sleep``: no request is lost;
2. **abort** — ``/pause?mode=abort`` then ``/sleep``: the in-flight requests fail, queued ones are kept;
3. **kill** — SIGKILL to the tenant's processes: the server listening on the tenant's port, when it is
   tagged ``TIMESLICE_TENANT`` in its environment, and every process it started (vLLM's engine core holds
   the GPU memory), each owned by the agent's user (any user's when the agent runs as root). An untagged
   server is never touched: without the tag the ladder ends at step 2 and the tenant is reported dead
   (the trainer gets the GPU all the same).

A behaving tenant never leaves step 1. Whoever started vLLM (a supervisor, a Kubernetes Deployment)
restarts a killed one; the agent's watchdog registers it again when it answers.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from timeslice_verl.agent.tenant import TenantDead, TenantError
from timeslice_verl.log import get_logger

log = get_logger("agent")

TENANT_TAG_ENV = "TIMESLICE_TENANT"
"""Set (to any non-empty value) in the environment of a vLLM server the agent may kill at step 3."""

STEPS = ("polite", "abort", "kill")
SHORT_DEADLINE_S = 5.0
"""Below it the polite step (60 %) may not cover a behaving vLLM's first sleep: the agent warns at start."""


@dataclass(frozen=True)
class Budgets:
    polite_s: float | None
    abort_s: float
    kill_s: float


def budgets(deadline_s: float) -> Budgets:
    """Split the deadline: the two harder steps get a quarter each, at most 2 s; 0 means no deadline."""
    if deadline_s <= 0:
        return Budgets(polite_s=None, abort_s=2.0, kill_s=2.0)
    reserve = min(2.0, deadline_s / 4)
    return Budgets(polite_s=deadline_s - 2 * reserve, abort_s=reserve, kill_s=reserve)


class TenantKilled(TenantDead):
    """The tenant ignored the deadline and the agent stopped it (or found nothing it may stop)."""


@dataclass
class Climb:
    """What one yield took: the step it ended on and each step's seconds."""

    step: str = "polite"
    phases: dict[str, float] | None = None
    detail: str = ""


async def _step(climb: Climb, name: str, move: Awaitable[Any], budget: float | None) -> str:
    """One step of the ladder within ``budget``: '' when it worked, else why not (a dead server raises).
    Without a budget (no deadline) a failure is raised as it is."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(move, budget)
        return ""
    except TenantDead:
        raise
    except (asyncio.TimeoutError, TenantError) as exc:
        if budget is None:
            raise
        return f"no answer within {budget:.1f} s" if isinstance(exc, asyncio.TimeoutError) else str(exc)
    finally:
        climb.phases[name] = time.monotonic() - t0  # type: ignore[index]


async def yield_within(
    tenant: Any, deadline_s: float, *, kill: Callable[[str, float], Awaitable[str]] | None = None
) -> Climb:
    """Yield ``tenant`` within ``deadline_s``. Raises :class:`TenantDead` (a dead server, or one the ladder
    had to kill) or :class:`TenantError` (without a deadline, as the polite step failed)."""
    b = budgets(deadline_s)
    climb = Climb(phases={})
    why = await _step(climb, "polite", tenant.yield_gpu(), b.polite_s)
    if not why:
        return climb
    climb.step = "abort"
    log.warning("tenant %s: polite yield failed (%s): aborting its in-flight requests", tenant.url, why)
    why2 = await _step(climb, "abort", tenant.abort_and_sleep(), b.abort_s)
    if not why2:
        climb.detail = f"ladder: abort (polite: {why})"
        return climb
    climb.step = "kill"
    log.error("tenant %s: abort failed too (%s): stopping its processes", tenant.url, why2)
    t2 = time.monotonic()
    outcome = await (kill or kill_tenant)(tenant.url, b.kill_s)
    climb.phases["kill"] = time.monotonic() - t2  # type: ignore[index]
    raise TenantKilled(f"ladder: kill after polite ({why}) and abort ({why2}): {outcome}")


# ---------------------------------------------------------------------------------- step 3


def _port(url: str) -> int | None:
    try:
        parts = urllib.parse.urlsplit(url)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def tenant_processes(url: str) -> tuple[list[int], str]:
    """The pids the kill step may stop for ``url`` (listener first), and why none when empty."""
    import psutil

    port = _port(url.split(",")[0])
    if port is None:
        return [], f"no port in {url!r}"
    try:
        listeners = {c.pid for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    except (psutil.Error, OSError) as exc:
        return [], f"cannot list the listening sockets ({exc})"
    if not listeners:
        return [], f"no process of this user listens on port {port}"
    me = os.geteuid()
    pids: list[int] = []
    refused: list[str] = []
    for pid in sorted(listeners):
        try:
            proc = psutil.Process(pid)
            if me != 0 and proc.uids().real != me:
                refused.append(f"{pid} (another user's)")
                continue
            if not proc.environ().get(TENANT_TAG_ENV):
                refused.append(f"{pid} (not tagged {TENANT_TAG_ENV})")
                continue
            children = proc.children(recursive=True)
        except psutil.Error as exc:
            refused.append(f"{pid} ({type(exc).__name__})")
            continue
        pids.append(pid)
        # what a tagged server started is part of it (vLLM's engine core holds the GPU memory), as long as it
        # is this user's
        for child in children:
            try:
                if me == 0 or child.uids().real == me:
                    pids.append(child.pid)
                else:
                    refused.append(f"{child.pid} (another user's)")
            except psutil.Error as exc:
                refused.append(f"{child.pid} ({type(exc).__name__})")
    if not pids:
        return [], f"the process(es) on port {port} may not be stopped: {', '.join(refused) or 'gone'}"
    return pids, f"left alone: {', '.join(refused)}" if refused else ""


async def kill_tenant(url: str, timeout_s: float) -> str:
    """SIGKILL the tenant's tagged processes and wait (up to ``timeout_s``) until they are gone; what happened."""
    return await asyncio.to_thread(_kill, url, timeout_s)


def _kill(url: str, timeout_s: float) -> str:
    import psutil

    pids, why = tenant_processes(url)
    if why and pids:
        log.warning("tenant %s: %s", url, why)
    if not pids:
        log.error("tenant %s: nothing stopped: %s", url, why)
        return f"nothing stopped ({why})"
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=max(0.1, timeout_s))
    log.error("tenant %s: SIGKILL sent to %s%s", url, pids, f"; still alive: {[p.pid for p in alive]}" if alive else "")
    return f"SIGKILL to {len(procs)} process(es) {pids}" + (f", {len(alive)} still alive" if alive else "")


__all__ = ["SHORT_DEADLINE_S", "Budgets", "Climb", "STEPS", "TENANT_TAG_ENV", "TenantKilled", "budgets", "kill_tenant", "tenant_processes",
           "yield_within"]
