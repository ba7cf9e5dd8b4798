"""The reclaim ladder: how the agent gets the GPU back from a tenant within a deadline, whatever it does.

A yield climbs down at most three steps, each with its share of ``tenant.reclaim_deadline_s``
(:func:`budgets`). A step that fails is tried again (with a short backoff) until its share is spent: one
HTTP 500 or a garbled answer is no reason to abort a tenant's requests, let alone kill it.

1. **polite** — ``/pause`` (``keep`` or ``wait``) then ``/sleep``: no request is lost;
2. **abort** — ``/pause?mode=abort`` then ``/sleep``: the in-flight requests fail, queued ones are kept;
3. **kill** — SIGKILL to the process registered as the tenant (:mod:`~timeslice_verl.agent.tenant.proc`:
   found by its listening socket at registration, recorded by pid and start time, tagged ``TIMESLICE_TENANT``,
   the agent's user's) and what it started. Without such a process nothing is stopped and the tenant is
   reported dead: the trainer gets the GPU all the same.

A tenant that the agent's probe found *wedged* (it stopped answering while it had the GPU) is asked once more,
briefly; if it still says nothing the ladder goes straight to the kill: the trainer does not wait out the polite
step's budget for a server that cannot answer. A tenant group climbs the ladder server by server, side by side:
a wedged server is killed, its peers yield politely.

A behaving tenant never leaves step 1. Whoever started vLLM (``timeslice-verl tenant run``, a Kubernetes
controller) restarts a killed one; the agent registers it again when it answers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from timeslice_verl.agent.tenant.vllm import TenantDead, TenantError
from timeslice_verl.agent.tenant.proc import TENANT_TAG_ENV  # noqa: F401 (re-exported)
from timeslice_verl.backoff import Backoff
from timeslice_verl.log import get_logger

log = get_logger("agent")

STEPS = ("polite", "abort", "kill")
SHORT_DEADLINE_S = 5.0
"""Below it the polite step (60 %) may not cover a behaving vLLM's first sleep: the agent warns at start."""
RETRY_S = 0.25
"""The first pause between two tries of a step (doubling, within the step's budget)."""
STEP_AGAIN = Backoff(RETRY_S, 3600.0)
CONFIRM_S = 0.5
"""How long a tenant taken for wedged gets to answer once more before the kill."""


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
    """The tenant ignored the deadline and the agent stopped it (or found nothing it may stop: ``nothing_stopped``)."""

    def __init__(self, message: str, killed: Any = None) -> None:
        super().__init__(message)
        self.nothing_stopped = bool(getattr(killed, "nothing_stopped", False))


@dataclass
class Climb:
    """What one yield took: the step it ended on and each step's seconds."""

    step: str = "polite"
    phases: dict[str, float] = field(default_factory=dict)
    detail: str = ""


async def _step(climb: Climb, name: str, move: Callable[[], Awaitable[Any]], budget: float | None) -> str:
    """One step of the ladder, tried until it works or ``budget`` is spent: '' when it worked, else why not (a
    dead server raises). Without a budget (no deadline) the first failure is raised as it is."""
    t0 = time.monotonic()
    why, pause = "", RETRY_S
    try:
        while True:
            left = None if budget is None else budget - (time.monotonic() - t0)
            if left is not None and left <= 0:
                return why or f"no answer within {budget:.1f} s"
            try:
                await asyncio.wait_for(move(), left)
                return ""
            except TenantDead:
                raise
            except asyncio.TimeoutError:
                if budget is None:
                    raise
                return f"no answer within {budget:.1f} s"
            except TenantError as exc:
                if budget is None:
                    raise
                why = str(exc)
                log.warning("%s step: %s (trying again within its %.1f s)", name, why, budget)
            left = budget - (time.monotonic() - t0)
            await asyncio.sleep(max(0.0, min(pause, left)))
            pause = STEP_AGAIN.next(pause)
    finally:
        climb.phases[name] = time.monotonic() - t0


async def yield_member(tenant: Any, deadline_s: float, *, wedged: bool = False, sleep: bool = True,
                       kill: Callable[[Any, float], Awaitable[Any]] | None = None) -> Climb:
    """Yield one server within ``deadline_s`` (``sleep=False``: the polite step only pauses it). Raises :class:`TenantDead` (a dead server, or one the ladder had
    to kill) or :class:`TenantError` (without a deadline, as the polite step failed)."""
    b = budgets(deadline_s)
    climb = Climb()
    if wedged and deadline_s > 0:
        climb.step = "kill"
        t0 = time.monotonic()
        answers = await tenant.alive(timeout=CONFIRM_S)
        climb.phases["confirm"] = time.monotonic() - t0
        if not answers:
            log.error("tenant %s: wedged (no answer to the agent's probe, nor within %.1f s now): stopping it",
                      tenant.name, CONFIRM_S)
            outcome = await _kill(climb, tenant, b.kill_s, kill)
            raise TenantKilled(f"ladder: kill of a wedged tenant (it stopped answering while it had the GPU): {outcome}",
                               outcome)
        climb.step = "polite"
    why = await _step(climb, "polite", lambda: tenant.yield_gpu(sleep), b.polite_s)
    if not why:
        return climb
    climb.step = "abort"
    log.warning("tenant %s: polite yield failed (%s): aborting its in-flight requests", tenant.name, why)
    why2 = await _step(climb, "abort", tenant.abort_and_sleep, b.abort_s)
    if not why2:
        climb.detail = f"ladder: abort (polite: {why})"
        return climb
    climb.step = "kill"
    log.error("tenant %s: abort failed too (%s): stopping its processes", tenant.name, why2)
    outcome = await _kill(climb, tenant, b.kill_s, kill)
    raise TenantKilled(f"ladder: kill after polite ({why}) and abort ({why2}): {outcome}", outcome)


async def _kill(climb: Climb, tenant: Any, budget: float, kill: Callable[[Any, float], Awaitable[Any]] | None) -> Any:
    t0 = time.monotonic()
    try:
        return await (kill or kill_tenant)(tenant, budget)
    finally:
        climb.phases["kill"] = time.monotonic() - t0


async def kill_tenant(tenant: Any, timeout_s: float) -> Any:
    """SIGKILL the process registered as ``tenant`` (and what it started); what happened."""
    from timeslice_verl.agent.tenant import proc as tenant_proc

    return await asyncio.to_thread(tenant_proc.kill, tenant.process, timeout_s, tenant.process_note)


async def yield_within(tenant: Any, deadline_s: float, *, wedged: set[str] | None = None, sleep: bool = True,
                       kill: Callable[[Any, float], Awaitable[Any]] | None = None) -> Climb:
    """Yield ``tenant`` (one server, or a group server by server) within ``deadline_s``; ``wedged``: the URLs the
    agent's probe found not answering; ``sleep=False``: a pause alone (the abort and kill steps still sleep)."""
    members = getattr(tenant, "live_members", None)
    if members is None:
        return await yield_member(tenant, deadline_s, wedged=bool(wedged and tenant.url in wedged), sleep=sleep, kill=kill)
    return await tenant.each_climb(lambda m: yield_member(m, deadline_s, wedged=bool(wedged and m.url in wedged),
                                                          sleep=sleep, kill=kill))


__all__ = ["SHORT_DEADLINE_S", "Budgets", "Climb", "STEPS", "TENANT_TAG_ENV", "TenantKilled", "budgets", "kill_tenant",
           "yield_member", "yield_within"]
