"""A tenant of several vLLM servers, one per GPU of a multi-GPU trainer, that yield and wake together."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from timeslice_verl.agent.tenant.ladder import STEPS, Climb, TenantKilled
from timeslice_verl.agent.tenant.vllm import ASLEEP, AWAKE, TenantDead, TenantError, TenantInfo, VllmTenant
from timeslice_verl.log import get_logger

log = get_logger("agent.tenant")


class TenantGroup:
    """Several vLLM servers (one per GPU of a multi-GPU trainer) that yield and wake together.

    Same interface as :class:`VllmTenant`; each move runs on every server at once. A server that does
    not answer (:class:`TenantDead`) is left out — like a single dead tenant it holds nothing the agent
    could hand over — and the others still move, so one dead vLLM never leaves its peers asleep; the
    group is dead only when none answers. Any other failure fails the move (the group is faulted, and
    the next reclaim wakes every server: waking an awake vLLM is harmless). :meth:`revive` brings a
    server that answers again into the group's state (a restarted vLLM comes up awake, on a GPU the
    trainer may hold).
    """

    def __init__(self, urls: list[str], **kwargs: Any) -> None:
        self.members = [VllmTenant(u, **kwargs) for u in urls]
        self.info = TenantInfo(url=self.members[0].url, sleep_level=self.members[0].info.sleep_level)
        self.state = AWAKE
        self.dead: set[str] = set()
        """URLs of the servers that did not answer the last move."""

    @property
    def urls(self) -> list[str]:
        """The servers' addresses, in the order they were registered."""
        return [m.url for m in self.members]

    @property
    def name(self) -> str:
        """How logs and the journal name it."""
        return f"{self.members[0].url} (+{len(self.members) - 1})"

    @property
    def note(self) -> str:
        return f"not answering, left out: {', '.join(sorted(self.dead))}" if self.dead else ""

    async def _each(self, move: str, call: Callable[[VllmTenant], Awaitable[Any]]) -> list[Any]:
        """``call`` on every server at once; the dead are left out (and noted), all dead is TenantDead."""
        results = await asyncio.gather(*(call(m) for m in self.members), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        dead = {m.url for m, r in zip(self.members, results) if isinstance(r, TenantDead)}
        if all(isinstance(r, TenantDead) for r in results):
            self.dead = dead
            raise TenantDead("; ".join(str(e) for e in errors))
        others = [e for e in errors if not isinstance(e, TenantDead)]
        if others:
            self.dead |= dead
            raise TenantError("; ".join(str(e) for e in others))
        if dead - self.dead:
            log.warning("%s: vLLM at %s does not answer; the group moves without it until it does", move,
                        ", ".join(sorted(dead - self.dead)))
        self.dead = dead
        return [r for r in results if not isinstance(r, BaseException)]

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.members), return_exceptions=True)

    def waiting_for(self) -> str:
        return "; ".join(w for w in (m.waiting_for() for m in self.members) if w)

    async def register(self) -> TenantInfo:
        infos = await self._each("register", lambda m: m.register())
        live = [m for m in self.members if m.url not in self.dead]
        self.info.version = ",".join(sorted({i.version for i in infos}))
        self.info.pause = "wait" if all(i.pause == "wait" for i in infos) else "drain"
        self.state = ASLEEP if any(m.state == ASLEEP for m in live) else AWAKE
        return self.info

    async def alive(self, timeout: float | None = None) -> bool:
        return any(await asyncio.gather(*(m.alive(timeout) for m in self.members)))

    @property
    def live_members(self) -> list[VllmTenant]:
        """The servers that answered the last move (the ones a yield asks)."""
        return [m for m in self.members if m.url not in self.dead]

    async def each_climb(self, climb: Callable[[VllmTenant], Awaitable[Any]]) -> Any:
        """A yield down the reclaim ladder, every answering server on its own ladder, side by side: a server the
        ladder had to kill is left out (as a dead one), the others still sleep. One :class:`Climb` for the group:
        the furthest step any server reached, each phase's longest, every server's detail."""
        live = self.live_members or self.members
        results = await asyncio.gather(*(climb(m) for m in live), return_exceptions=True)
        killed = [(m, r) for m, r in zip(live, results) if isinstance(r, TenantKilled)]
        await self._each_outcome("yield", live, results)  # raises when none is left, or one answered wrongly
        self.state = ASLEEP
        climbs = [r for r in results if isinstance(r, Climb)]
        out = Climb(step=max((c.step for c in climbs), key=STEPS.index, default="polite"))
        for c in climbs:
            for phase, seconds in c.phases.items():
                out.phases[phase] = max(seconds, out.phases.get(phase, 0.0))
        details = [f"{m.url}: {c.detail}" for m, c in zip(live, results) if isinstance(c, Climb) and c.detail]
        details += [f"{m.url}: {exc}" for m, exc in killed]
        if killed:
            out.step = "kill"
        out.detail = "; ".join(details)
        return out

    async def _each_outcome(self, move: str, members: list[VllmTenant], results: list[Any]) -> None:
        """What :meth:`_each` makes of the results of a move on ``members``."""
        dead = {m.url for m, r in zip(members, results) if isinstance(r, TenantDead)}
        errors = [r for r in results if isinstance(r, BaseException)]
        if all(isinstance(r, TenantDead) for r in results):
            self.dead |= dead
            raise type(errors[0])("; ".join(str(e) for e in errors)) if errors else TenantDead("no server")
        others = [e for e in errors if not isinstance(e, TenantDead)]
        self.dead |= dead
        if others:
            raise TenantError("; ".join(str(e) for e in others))
        if dead:
            log.warning("%s: vLLM at %s left out of the group (not answering, or stopped by the ladder)", move,
                        ", ".join(sorted(dead)))

    @property
    def held(self) -> bool:
        return any(m.held for m in self.live_members)

    async def yield_gpu(self, sleep: bool = True) -> float:
        t0 = time.perf_counter()
        await self._each("yield", lambda m: m.yield_gpu(sleep))
        self.state = ASLEEP
        return time.perf_counter() - t0

    async def sleep_held(self) -> float:
        t0 = time.perf_counter()
        await self._each("sleep", lambda m: m.sleep_held())
        return time.perf_counter() - t0

    async def abort_and_sleep(self) -> float:
        t0 = time.perf_counter()
        await self._each("abort", lambda m: m.abort_and_sleep())
        self.state = ASLEEP
        return time.perf_counter() - t0

    async def reclaim(self) -> float:
        t0 = time.perf_counter()
        await self._each("reclaim", lambda m: m.reclaim())
        self.state = AWAKE
        return time.perf_counter() - t0

    async def revive(self) -> list[str]:
        """Bring each left-out server that answers again into the group's state; the URLs that rejoined.

        Run it while no other move runs (the agent holds its step lock)."""
        back = []
        for m in [m for m in self.members if m.url in self.dead]:
            if not await m.alive():
                continue
            try:
                await m.register()
                if self.state == ASLEEP and m.state == AWAKE:
                    await m.yield_gpu()
                elif self.state == AWAKE and m.state == ASLEEP:
                    await m.reclaim()
            except TenantError as exc:
                log.warning("vLLM at %s answers again but could not join the group (%s): %s", m.url, self.state, exc)
                continue
            self.dead.discard(m.url)
            back.append(m.url)
            log.info("vLLM at %s answers again and follows the group: %s", m.url, self.state)
        return back


def make_tenant(urls: list[str], **kwargs: Any) -> VllmTenant | TenantGroup:
    """One server, or a group for several."""
    return VllmTenant(urls[0], **kwargs) if len(urls) == 1 else TenantGroup(urls, **kwargs)


__all__ = ["TenantGroup", "make_tenant"]
