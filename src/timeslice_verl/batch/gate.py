"""The batch service's gate: whether lines may go to the tenant now — while the node's agent says the tenant owns
the GPU, and only then.

* **The agent decides.** :class:`Gate` follows ``watch_owner`` (answered the moment the owner changes; an older
  agent's ``status`` every ``poll_s``). An agent that does not answer closes the gate until it answers again (fail
  closed: a sleeping vLLM still answers ``/health``, so the tenant's health says nothing about the trainer).
  Without an agent (``timeslice.batch.follow_agent=false``) the gate follows the tenant's ``/health``.
* **A tenant that is gone.** A refused or cut connection makes the gate *suspect* the tenant: one ``/health`` probe
  at a time; only when that fails too does the gate close, until ``/health`` answers again (a server being
  restarted costs the lines sent meanwhile one try, not all of theirs). One reset never stops the other lines.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.batch.background import spawn
from timeslice_verl.batch.status import AGENT_SILENT
from timeslice_verl.log import get_logger

log = get_logger("batch")

WATCH_S = 10.0
"""How long one ``watch_owner`` waits for a change before it is asked again."""
HEALTH_TIMEOUT_S = 5.0


async def healthy(session: aiohttp.ClientSession) -> tuple[bool, str]:
    """Whether the tenant answers ``/health``, and why not."""
    try:
        async with session.get("/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
            ok = resp.status < 300
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return False, f"the tenant does not answer ({type(exc).__name__})"
    return ok, "the tenant answers" if ok else f"the tenant is not healthy (HTTP {resp.status})"


class Gate:
    """Whether the tenant has the GPU now, and for how long it has had it in all (``seconds_open``)."""

    def __init__(self, agent_socket: str | None, poll_s: float = 0.5) -> None:
        self.agent_socket, self.poll_s = agent_socket, poll_s
        self.open = False
        self.open_s = 0.0
        self.source = "agent" if agent_socket else "tenant health"
        self.unreachable = ""
        """Why the tenant was found gone; until its ``/health`` answers again, no line goes out."""
        self.why = ""
        """Why the gate is as it is, as last found ("" before the first look)."""
        self._since = 0.0
        self._owner = ""
        self._watch = True
        self._probing = False
        self._changed = asyncio.Event()
        self._agent: AgentClient | None = AgentClient(agent_socket, connect_timeout_s=1.0, client="batch") if agent_socket else None

    def seconds_open(self) -> float:
        return self.open_s + (time.monotonic() - self._since if self.open else 0.0)

    def _set(self, value: bool, why: str) -> None:
        self.why = why
        if value == self.open:
            return
        now = time.monotonic()
        if self.open:
            self.open_s += now - self._since
        self.open, self._since = value, now
        log.info("batch: %s (%s)", "sending to the tenant" if value else "holding lines", why)
        self._changed.set()

    def suspect(self, session: aiohttp.ClientSession, why: str) -> None:
        """A request met a refused or cut connection: probe ``/health`` once (not once per line); close if it fails."""
        if self._probing or self.unreachable:
            return
        self._probing = True

        async def probe() -> None:
            try:
                ok, _ = await healthy(session)
                if not ok and not self.unreachable:
                    self.unreachable = why
                    self._set(False, f"the tenant is unreachable: {why}")
            finally:
                self._probing = False

        spawn(probe(), "batch-gate-probe")

    async def wait_open(self) -> None:
        while not self.open:
            self._changed.clear()
            await self._changed.wait()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            value, why = await self._look(session)
            if value and self.unreachable:
                value, why = await healthy(session)
                if value:
                    log.info("batch: the tenant answers again (it was unreachable: %s)", self.unreachable)
                    self.unreachable = ""
            self._set(value, why)
            if self._agent is None or not self._watch or self.unreachable or self.source != "agent":
                await asyncio.sleep(self.poll_s)

    async def _look(self, session: aiohttp.ClientSession) -> tuple[bool, str]:
        """Who has the GPU: the agent's answer once the owner changes, else (no agent configured) the tenant's health."""
        if self._agent is None:
            return await healthy(session)
        try:
            if self._watch:
                seen = "tenant" if self.open else self._owner
                answer: Any = await asyncio.to_thread(self._agent.watch_owner, seen, WATCH_S)
            else:
                answer = await asyncio.to_thread(self._agent.status)
        except AgentError as exc:
            if exc.code == "unknown_op" and self._watch:
                self._watch = False  # an agent from before watch_owner
                return self.open, "the agent cannot be watched: asking its status"
            if self.source == "agent":
                log.warning("batch: the agent does not answer (%s): holding lines until it does", exc)
            self.source = "agent (not answering)"
            return False, AGENT_SILENT
        self.source = "agent"
        self._owner = str(answer.get("owner", ""))
        return self._owner == "tenant", f"the GPU's owner: {self._owner}"

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()


__all__ = ["Gate", "healthy"]
