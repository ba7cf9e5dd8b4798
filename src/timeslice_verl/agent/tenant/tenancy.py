"""The agent's tenant: which vLLM it lends the GPU to, its moves (yield down the reclaim ladder, reclaim), and what
the agent sees of it between moves.

* **Registration** — a loopback URL, or the one the agent was started with; one at a time (an ``ok`` means it);
  a supervisor (``timeslice-verl tenant run``) registers each server it (re)starts and says how often and why.
* **Moves** — a yield within ``tenant.reclaim_deadline_s`` (:mod:`~timeslice_verl.agent.tenant.ladder`), a reclaim that
  gives way to a trainer that asks. A move that fails marks the tenant dead or faulted, with a backoff before the
  next try; a tenant the ladder could not stop is tried again only after a long one.
* **The probe** — while the tenant has the GPU, every ``tenant.probe_interval_s`` the agent asks each server the
  state it is in: one that does not answer twice in a row is *wedged* (status, metrics, log; reclaiming it goes
  straight to the kill), one that says it is asleep or paused while recorded awake (a request given up on that
  landed late) is recorded asleep, so the reconciler wakes it: the state the agent reports is the tenant's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import httpx

from timeslice_verl.agent.journal import Journal
from timeslice_verl.backoff import Backoff
from timeslice_verl.agent.tenant.behind import Behind
from timeslice_verl.agent.tenant.ladder import TenantKilled, yield_within
from timeslice_verl.agent.tenant.options import TenantOptions
from timeslice_verl.agent.policy import TENANT_FAULTED
from timeslice_verl.agent.client.protocol import ErrorCode, ProtocolError
from timeslice_verl.agent.state import TenantRecord
from timeslice_verl.agent.tenant.vllm import ASLEEP, AWAKE, DEAD, TenantDead, TenantError, VllmTenant
from timeslice_verl.agent.tenant.group import TenantGroup, make_tenant
from timeslice_verl.log import get_logger
from timeslice_verl.names import clean_urls

log = get_logger("agent")

WEDGED_AFTER = 2
"""Probes in a row without an answer before a tenant is taken for wedged."""
MOVE_AGAIN = Backoff(0.5, 30.0)
"""After a failed tenant move, before the next try."""
STOPPED_AGAIN = Backoff(30.0, 300.0)
"""After a ladder that found nothing it could stop, before the tenant is registered again."""
FIRST_SLEEP = "first sleep since registration"
"""How the journal marks a server's first sleep: its one-off costs are never the yield the trainer's estimate uses."""


def _loopback(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ReclaimAbandoned(Exception):
    """A tenant reclaim gave way to a trainer that asked for the GPU."""


@dataclass
class Registered:
    """The registered tenant and what the agent records of it: one value, set and cleared together."""

    tenant: VllmTenant | TenantGroup
    record: TenantRecord


class Tenancy:
    def __init__(self, journal: Journal, *, step_lock: asyncio.Lock, persist: Callable[[], None],
                 wake: Callable[[], None], trainer_waiting: Callable[[], str | None], room: Callable[[int], bool],
                 options: TenantOptions = TenantOptions()) -> None:
        self.journal, self.step_lock, self.persist, self.wake = journal, step_lock, persist, wake
        self.trainer_waiting, self.room = trainer_waiting, room
        o = options
        self.request_timeout_s, self.drain_timeout_s, self.pause_mode = o.request_timeout_s, o.drain_timeout_s, o.pause_mode
        self.reclaim_deadline_s, self.probe_timeout_s = o.reclaim_deadline_s, o.probe_timeout_s
        self.pause_grant_s = o.pause_grant_s
        self.behind = Behind()
        """A pause-only yield still running after its grant (:mod:`~timeslice_verl.agent.tenant.behind`)."""
        self.configured_urls: list[str] = []
        """The tenant addresses of the agent's own config: the ones a client may register off this node."""
        self.registered: Registered | None = None
        self.footprint = 0
        """What the tenant takes on the GPU awake (NVML: what its sleep freed)."""
        self.ladder_counts: dict[str, int] = {}
        self.ladder_last = ""
        self.wedged: set[str] = set()
        self._misses: dict[str, int] = {}
        self.supervisor: dict[str, Any] = {}
        self.backoff_s = 0.0
        self.retry_at = 0.0
        """After a failed move: not before this (``time.monotonic``)."""
        self.next_probe = 0.0
        """When a dead or faulted tenant is asked again whether it answers."""
        self.lock = asyncio.Lock()
        """Held by a registration or unregistration (one at a time; taken before the step lock)."""
        self.warm_up = o.warm_up
        self.warm_up_due = False
        """A registered tenant awaits its warm-up (:mod:`~timeslice_verl.agent.tenant.warmup`)."""
        self.warming = False
        self.yields = 0
        """Sleeps since the tenant was registered: the first pays a vLLM's one-off costs, never its steady yield."""

    @property
    def tenant(self) -> VllmTenant | TenantGroup | None:
        return self.registered.tenant if self.registered else None

    @property
    def record(self) -> TenantRecord | None:
        return self.registered.record if self.registered else None

    @property
    def state(self) -> str:
        """The recorded state; ``asleep`` (held) while a pause runs behind a grant."""
        if self.registered is None:
            return ""
        return ASLEEP if self.behind.pending else self.registered.record.state

    def _now(self) -> Registered:
        """The registered tenant a move acts on (a move runs only while one is: the step lock keeps it)."""
        if self.registered is None:
            raise TenantError("no tenant is registered")
        return self.registered

    def make(self, urls: list[str], sleep_level: int) -> VllmTenant | TenantGroup:
        return make_tenant(urls, sleep_level=sleep_level, request_timeout_s=self.request_timeout_s,
                           drain_timeout_s=self.drain_timeout_s, pause_mode=self.pause_mode)

    # ------------------------------------------------------------------ registration

    async def register(self, urls: list[str], sleep_level: int = 1, *, persist: bool = True,
                       supervisor: dict[str, Any] | None = None) -> dict[str, Any]:
        """Register (or re-check) the tenant: an answer ``ok`` means it is registered when it is sent."""
        async with self.lock:
            out = await self._register(clean_urls(urls), sleep_level, persist)
        if supervisor:
            self.supervisor = {**supervisor, "urls": urls, "at": time.time()}
            log.info("tenant %s: registered by its supervisor (pid %s, %s restart(s)%s)", urls, supervisor.get("pid"),
                     supervisor.get("restarts", 0), f"; last: {supervisor['last_exit']}" if supervisor.get("last_exit") else "")
        return out

    async def _register(self, urls: list[str], sleep_level: int, persist: bool) -> dict[str, Any]:
        if not all(_loopback(u) for u in urls) and urls != self.configured_urls:
            raise ProtocolError(ErrorCode.PERMISSION, f"tenant {urls} is not on this node (loopback): only the addresses "
                                "the agent was started with (timeslice.tenant.urls) may point elsewhere")
        if self.tenant is not None and self.tenant.urls != urls:
            if isinstance(self.tenant, TenantGroup) and self.record and set(urls) < set(self.tenant.urls):
                self.next_probe = 0.0  # one server's own supervisor: the watchdog's next probe brings it back
                log.info("tenant %s: a server of the group registered again; it rejoins at the watchdog's next probe", urls)
                return {**self.record.to_dict(), "member": urls}
            raise ProtocolError(ErrorCode.BUSY, f"a tenant is already registered ({self.tenant.urls}); unregister it first")
        try:
            tenant = self.tenant or self.make(urls, sleep_level)
        except (httpx.InvalidURL, ValueError) as exc:  # what the HTTP client refuses is the request's fault
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field 'urls': {urls!r:.200} is not a URL an HTTP client takes: {exc}") from None
        await self.behind.settled()  # a pause behind a grant lands first: the state read is the one that stays
        try:
            info = await tenant.register()
        except TenantError as exc:
            if self.tenant is None:
                await tenant.close()
            raise ProtocolError(ErrorCode.TENANT, str(exc)) from None
        record = TenantRecord(urls=tenant.urls, state=tenant.state, version=info.version, sleep_level=sleep_level,
                              error=tenant.note)
        async with self.step_lock:  # never swapped under a move that uses it
            self.registered = Registered(tenant, record)
            self.wedged.clear()
            self._misses.clear()
        self._registered()
        if persist:
            self.persist()
        self.wake()
        return record.to_dict()

    def _registered(self) -> None:
        """A server (re)registered: its next sleep may be its first."""
        self.yields = 0
        self.warm_up_due = self.warm_up and self.state == AWAKE

    def adopt_dead(self, urls: list[str], sleep_level: int, why: str) -> None:
        """A configured tenant that did not answer at the agent's start: recorded dead, tried again later."""
        self.registered = Registered(self.make(urls, sleep_level),
                                     TenantRecord(urls=list(urls), state=DEAD, sleep_level=sleep_level, error=why))

    async def unregister(self) -> dict[str, Any]:
        """Forget the tenant, waking it first (it is never left asleep)."""
        async with self.lock, self.step_lock:  # no registration, no move meanwhile
            await self.behind.settled()
            if self.tenant is None:
                return {"unregistered": False}
            if self.record and self.record.state in (ASLEEP, TENANT_FAULTED):
                try:
                    await self.reclaim(check_memory=False)
                except Exception as exc:
                    log.error("unregister: tenant could not be woken: %s", exc)
            urls = self.tenant.urls
            await self.tenant.close()
            self.registered = None
            self.persist()
        return {"unregistered": True, "urls": urls}

    async def close(self) -> None:
        if self.tenant is not None:
            await self.tenant.close()

    # ------------------------------------------------------------------ moves

    @property
    def held(self) -> bool:
        """The tenant is paused but awake (a pause-only yield): its memory is still on the GPU."""
        if self.tenant is None or not self.record:
            return False
        return self.behind.pending or (self.record.state == ASLEEP and self.tenant.held)

    async def yield_gpu(self, probe_free: Callable[[], int] | None = None, *, sleep: bool = True, why: str = "") -> None:
        """Yield the tenant within ``reclaim_deadline_s``, down the ladder if it must; ``sleep=False``: a pause alone
        (``why``: the figures that allowed it)."""
        self._now()
        start = time.time()
        free_before = probe_free() if probe_free else 0
        wedged = set(self.wedged)
        climb = await self._move("tenant_yield", lambda: yield_within(self.tenant, self.reclaim_deadline_s, wedged=wedged,
                                                                      sleep=sleep))
        if climb is None:
            return
        self.wedged -= wedged
        seconds = sum(climb.phases.values())
        held = self.tenant.held
        what = f"pause only (held awake; {why}) in {seconds:.3f} s" if held else f"pause+sleep in {seconds:.3f} s"
        detail = self.slept(start, free_before, probe_free if not held else None, climb.detail or what, climb.phases)
        if climb.step != "polite":
            self.ladder(climb.step, detail)
        else:
            self.backoff_s = 0.0
        log.info("tenant yield: vLLM %s in %.3f s%s", "paused, held awake" if held else "paused and asleep", seconds,
                 f" ({detail})" if climb.detail or held else "")
        self.persist()

    async def pause_behind(self, probe_free: Callable[[], int] | None, why: str) -> None:
        """A pause-only yield the trainer waits for ``pause_grant_s`` at most: it completes behind the grant."""
        if await self.behind.start(self.yield_gpu(probe_free, sleep=False, why=why), self.pause_grant_s, self.wake):
            log.info("tenant pause not answered within %.3f s: the trainer gets the GPU, the pause lands behind it",
                     self.pause_grant_s)

    async def sleep_held(self, probe_free: Callable[[], int] | None, why: str) -> None:
        """A tenant held awake goes to sleep: the trainer needs the memory (its peak grew, or a restore is due)."""
        self._now()
        start, free_before = time.time(), probe_free() if probe_free else 0
        seconds = await self._move("tenant_sleep", self.tenant.sleep_held)
        if seconds is None:
            return
        if probe_free is not None:
            self.footprint = max(0, probe_free() - free_before)
        self.journal.record("tenant_sleep", self.tenant.name, start, True, self.footprint, f"held tenant asleep in "
                            f"{seconds:.3f} s: {why}")
        log.warning("tenant held awake put to sleep in %.3f s: %s", seconds, why)
        self.persist()

    def slept(self, start: float, free_before: int, probe_free: Callable[[], int] | None, detail: str,
               phases: dict[str, float]) -> str:
        """A yield succeeded: the footprint it freed (unless held awake), the state, the journal; the detail
        journaled."""
        self._now()
        if probe_free is not None:
            self.footprint = max(0, probe_free() - free_before)
        self.record.state, self.record.error = ASLEEP, self.tenant.note
        self.yields += 1
        self.warm_up_due = False
        if self.yields == 1:  # said after the detail: what reads a ladder's step off its start still does
            detail = f"{detail} ({FIRST_SLEEP})"
        self.journal.record("tenant_yield", self.tenant.name, start, True, self.footprint, detail, phases)
        return detail

    async def reclaim(self, *, check_memory: bool) -> None:
        self._now()
        if check_memory and not self.room(self.footprint):
            log.warning("not waking vLLM: it needs %.2f GiB and the GPU has less free", self.footprint / 2**30)
            return
        start, held = time.time(), self.tenant.held
        seconds = await self._move("tenant_reclaim", self.tenant.reclaim)
        if seconds is None:
            return
        self.record.state, self.record.error = AWAKE, self.tenant.note
        self.backoff_s = 0.0
        self._misses.clear()
        what = "resume" if held else "wake+resume"
        self.journal.record("tenant_reclaim", self.tenant.name, start, True, self.footprint, f"{what} in {seconds:.3f} s")
        log.info("tenant reclaim: vLLM %s and serving in %.3f s", "resumed" if held else "awake", seconds)
        self.persist()

    def ladder(self, step: str, detail: str) -> None:
        """A yield went past the polite step: counted, shown by ``status``, sent to the metrics."""
        self.ladder_counts[step] = self.ladder_counts.get(step, 0) + 1
        self.ladder_last = f"{time.strftime('%H:%M:%S')} {step}: {detail}"
        self.journal.notify("ladder", {"step": step, "detail": detail})

    async def unless_a_trainer_asks(self, move: Awaitable[Any]) -> Any:
        """Run a tenant reclaim (or re-registration), abandoning it the moment a trainer queues."""
        task = asyncio.ensure_future(move)

        async def trainer_queued() -> None:
            while not self.trainer_waiting():
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(trainer_queued())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise ReclaimAbandoned(f"tenant reclaim abandoned: job {self.trainer_waiting()!r} asked for the GPU")

    async def _move(self, action: str, move: Callable[[], Any]) -> Any:
        """Run a tenant yield/reclaim; on failure journal it, mark the tenant dead or faulted, return None."""
        self._now()
        start = time.time()
        try:
            if action == "tenant_reclaim":
                return await self.unless_a_trainer_asks(move())
            return await move()
        except ReclaimAbandoned as exc:  # the tenant may be half awake: the next step yields it again
            self.record.state, self.record.error = AWAKE, str(exc)
            self.journal.record(action, self.tenant.name, start, False, detail=str(exc))
            log.info("%s (the valley ended before the tenant was awake)", exc)  # by design: the trainer comes first
            self.persist()
            return None
        except TenantError as exc:
            self.fail(action, start, exc)
            return None

    def fail(self, action: str, start: float, exc: TenantError) -> None:
        self._now()
        killed = isinstance(exc, TenantKilled)
        if killed:
            self.ladder("kill", str(exc))
            self.wedged.clear()
        dead = isinstance(exc, TenantDead)
        self.record.state, self.record.error = (DEAD if dead else TENANT_FAULTED), str(exc)
        self.journal.record(action, self.tenant.name, start, False, detail=str(exc))
        again = STOPPED_AGAIN if killed and exc.nothing_stopped else MOVE_AGAIN  # type: ignore[attr-defined]
        self.backoff_s = again.next(self.backoff_s)
        self.retry_at = time.monotonic() + self.backoff_s  # no hot loop on a failing tenant
        self.next_probe = max(time.monotonic() + 5.0, self.retry_at)
        log.error("%s failed: %s%s; next try in %.1f s", action, exc, " (the trainer is unaffected)" if dead else "",
                  self.backoff_s)
        self.persist()

    def describe(self) -> dict[str, Any] | None:
        if self.record is None:
            return None
        yields = [t for _, t in reversed(self.journal.moves) if t.action == "tenant_yield" and t.ok]
        last_yield = next((t for t in yields if FIRST_SLEEP not in t.detail), yields[0] if yields else None)
        last_wake = self.journal.last("tenant_reclaim")
        latest = self.journal.last("tenant_yield", ok=None)  # a ladder's kill ends a yield that failed
        return {**self.record.to_dict(), "footprint": self.footprint, "wedged": sorted(self.wedged),
                "warming": self.warm_up_due or self.warming,
                "yield_s": round(last_yield.seconds, 3) if last_yield else None,
                "yield_at": round(latest.start, 3) if latest else None,
                "yield_detail": latest.detail if latest else "",
                "reclaim_s": round(last_wake.seconds, 3) if last_wake else None,
                "supervisor": dict(self.supervisor) if self.supervisor else None}


__all__ = ["ReclaimAbandoned", "Tenancy"]
