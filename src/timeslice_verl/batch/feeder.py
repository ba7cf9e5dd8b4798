"""The batch service's feeder: sends queued lines to the node's tenant, as many at a time as ``concurrency``, while the
tenant has the GPU, and decides each answer's fate.

* **The gate.** :class:`Gate` asks the node's agent who owns the GPU (``status``, every ``poll_s``): lines go out while
  the tenant does. Requests already out when a trainer takes the GPU back are held by vLLM (pause ``keep``) and
  finish after the wake-up. Without an agent the gate follows the tenant's ``/health``.
* **Retries.** A line whose request failed for a reason that is not the request's — the ladder's abort (an answer
  with ``finish_reason: abort``), a killed or restarting server (the connection refused, reset or cut), a time-out,
  a 5xx — is queued again after a backoff (0.5 s doubling, at most 30 s), at most ``max_attempts`` times; then it
  goes to the error file with the last reason. A 4xx is the request's own fault: failed at once, with vLLM's answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.batch.store import Line, Store
from timeslice_verl.log import get_logger

log = get_logger("batch")

BACKOFF_S, BACKOFF_MAX_S = 0.5, 30.0
WATCH_S = 10.0
"""How long one ``watch_owner`` waits for a change before it is asked again."""


class Gate:
    """Whether the tenant has the GPU now, and for how long it has had it in all (``open_s``)."""

    def __init__(self, tenant_url: str, agent_socket: str | None, poll_s: float = 0.5) -> None:
        self.tenant_url, self.agent_socket, self.poll_s = tenant_url, agent_socket, poll_s
        self.open = False
        self.open_s = 0.0
        self.source = "agent" if agent_socket else "tenant health"
        self.unreachable = ""
        """Why the tenant refused a connection; until its ``/health`` answers again, no line goes out (a server being
        restarted costs the lines sent meanwhile one try, not all of theirs)."""
        self._since = 0.0
        self._owner = ""
        self._watch = True
        self._changed = asyncio.Event()
        self._agent: AgentClient | None = AgentClient(agent_socket, connect_timeout_s=1.0, client="batch") if agent_socket else None

    def seconds_open(self) -> float:
        return self.open_s + (time.monotonic() - self._since if self.open else 0.0)

    def _set(self, value: bool, why: str) -> None:
        if value == self.open:
            return
        now = time.monotonic()
        if self.open:
            self.open_s += now - self._since
        self.open, self._since = value, now
        log.info("batch: %s (%s)", "sending to the tenant" if value else "holding lines", why)
        self._changed.set()

    def lost(self, why: str) -> None:
        """A request found the tenant unreachable: close until it answers."""
        if not self.unreachable:
            self.unreachable = why
            self._set(False, f"the tenant is unreachable: {why}")

    async def wait_open(self) -> None:
        while not self.open:
            self._changed.clear()
            await self._changed.wait()

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            value, why = await self._look(client)
            if value and self.unreachable:
                value, why = await self._health(client)
                if value:
                    log.info("batch: the tenant answers again (it was unreachable: %s)", self.unreachable)
                    self.unreachable = ""
            self._set(value, why)
            if self.source != "agent" or self.unreachable:
                await asyncio.sleep(self.poll_s)

    async def _look(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        """Who has the GPU: the agent's answer once the owner changes (``watch_owner``: at once, no polling; an
        older agent's status every ``poll_s``), else the tenant's health."""
        if self._agent is not None:
            try:
                if self._watch:
                    seen = "tenant" if self.open else self._owner
                    answer = await asyncio.to_thread(self._agent.watch_owner, seen, WATCH_S)
                else:
                    answer = await asyncio.to_thread(self._agent.status)
            except AgentError as exc:
                if exc.code == "unknown_op" and self._watch:
                    self._watch = False  # an agent from before watch_owner
                    return self.open, "the agent cannot be watched: asking its status"
                if self.source == "agent":
                    log.warning("batch: the agent does not answer (%s): following the tenant's health instead", exc)
                self.source = "tenant health"
                self._watch = True
            else:
                self.source = "agent"
                self._owner = str(answer.get("owner", ""))
                return self._owner == "tenant", f"the GPU's owner: {self._owner}"
        return await self._health(client)

    @staticmethod
    async def _health(client: httpx.AsyncClient) -> tuple[bool, str]:
        try:
            ok = (await client.get("/health", timeout=5)).is_success
        except httpx.HTTPError as exc:
            return False, f"the tenant does not answer ({type(exc).__name__})"
        return ok, "the tenant answers" if ok else "the tenant is not healthy"

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()


def classify(status: int, body: Any) -> tuple[str, str]:
    """What an answer means for its line: ``done``, ``again`` (not the request's fault) or ``failed``; and why."""
    if 200 <= status < 300:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or not choices:
            return "again", "an answer without choices"
        if any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
            return "again", "aborted by the tenant (the reclaim ladder's abort step)"
        return "done", ""
    if status >= 500 or status in (408, 429):
        return "again", f"HTTP {status}"
    return "failed", f"HTTP {status}"


class Feeder:
    def __init__(self, store: Store, tenant_url: str, gate: Gate, *, concurrency: int = 32, max_attempts: int = 5,
                 request_timeout_s: float = 600.0, metrics: Any = None) -> None:
        self.store, self.tenant_url, self.gate = store, tenant_url.rstrip("/"), gate
        self.concurrency, self.max_attempts, self.request_timeout_s = concurrency, max_attempts, request_timeout_s
        self.metrics = metrics
        self._inflight: set[asyncio.Task] = set()
        self._kick = asyncio.Event()

    def kick(self) -> None:
        """New lines (a batch was created): look for work now."""
        self._kick.set()

    async def run(self) -> None:
        recovered = await asyncio.to_thread(self.store.recover)
        if recovered:
            log.warning("batch: %d line(s) were in flight when the service stopped: queued again", recovered)
        limits = httpx.Limits(max_connections=self.concurrency + 4, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.tenant_url, timeout=self.request_timeout_s, limits=limits) as client:
            gate = asyncio.create_task(self.gate.run(client), name="batch-gate")
            try:
                await self._feed(client)
            finally:
                gate.cancel()
                for task in list(self._inflight):
                    task.cancel()

    async def _feed(self, client: httpx.AsyncClient) -> None:
        last_settle = 0.0
        while True:
            await self.gate.wait_open()
            free = self.concurrency - len(self._inflight)
            lines = await asyncio.to_thread(self.store.claim, free, time.time()) if free > 0 else []
            for line in lines:
                task = asyncio.create_task(self._send(client, line))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
            if time.monotonic() - last_settle > 5:  # batches past their window expire even when idle
                last_settle = time.monotonic()
                await asyncio.to_thread(self._settle_open)
            if self.metrics is not None:
                self.metrics.update(self)
            if not lines or free <= len(lines):
                await self._idle()

    async def _idle(self) -> None:
        """Until a line ends, a batch comes, or a moment passes (lines waiting out a backoff)."""
        self._kick.clear()
        waiters = [asyncio.ensure_future(self._kick.wait())]
        waiters += [asyncio.ensure_future(asyncio.wait(set(self._inflight), return_when=asyncio.FIRST_COMPLETED))] if self._inflight else []
        done, pending = await asyncio.wait(waiters, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()

    def _settle_open(self) -> None:
        for row in self.store.query("SELECT id FROM batches WHERE status IN ('in_progress', 'cancelling')"):
            self.store.settle(row["id"])

    async def _send(self, client: httpx.AsyncClient, line: Line) -> None:
        try:
            resp = await client.post(line.endpoint, json=line.body)
        except httpx.HTTPError as exc:  # refused, reset, cut, timed out: the server's trouble, not the request's
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                self.gate.lost(why)
            await self._again(line, why)
            return
        try:
            body: Any = resp.json()
        except ValueError:
            body = {"text": resp.text[:2000]}
        fate, why = classify(resp.status_code, body)
        response = {"status_code": resp.status_code, "request_id": resp.headers.get("x-request-id", ""), "body": body}
        if fate == "done":
            tokens = int(((body.get("usage") or {}).get("completion_tokens")) or 0)
            await asyncio.to_thread(self.store.done, line, response, tokens)
        elif fate == "again":
            await self._again(line, why)
        else:
            message = (body.get("message") or (body.get("error") or {}).get("message")) if isinstance(body, dict) else ""
            error = {"code": "model_not_found" if resp.status_code == 404 else "request_failed",
                     "message": f"{why}: {message or resp.text[:300]}"}
            await asyncio.to_thread(self.store.failed, line, error, response)

    async def _again(self, line: Line, why: str) -> None:
        if line.attempts >= self.max_attempts:
            error = {"code": "attempts_exhausted", "message": f"{line.attempts} attempt(s), the last: {why}"}
            await asyncio.to_thread(self.store.failed, line, error)
            return
        delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (line.attempts - 1))
        log.debug("batch: line %s of %s again in %.1f s (%s)", line.custom_id, line.batch_id, delay, why)
        await asyncio.to_thread(self.store.again, line, delay)


__all__ = ["Feeder", "Gate", "classify"]
