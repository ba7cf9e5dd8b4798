"""The vLLM tenant: the batch server that borrows the GPU while no trainer job holds it.

Contract (docs/architecture.md §5), server started with ``VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode``:

* yield   = ``POST /pause?mode=keep`` (vLLM ≥ 0.17: in-flight requests stop where they are and resume
  after the wake-up; ``mode=wait`` lets them finish first; older: wait until ``/metrics`` shows no
  running or waiting request) → ``POST /sleep?level=N&mode=keep``
  (``/sleep`` pauses again with its own mode, ``abort`` by default, which would fail the requests
  queued since the pause: ``keep`` holds them until ``/resume``); a yield that overruns the reclaim deadline goes down the ladder
  (:mod:`~timeslice_verl.agent.ladder`: ``/pause?mode=abort``, then the tenant's processes are stopped);
* reclaim = ``POST /wake_up`` → ``POST /resume``;
* state   = ``GET /is_sleeping``, ``GET /is_paused``, ``GET /health``.

A serving engine is never put to sleep: the sleep is only sent after the pause (or drain) is
confirmed. Response bodies are ignored except the two state flags; non-2xx is an error. A server
that stops answering is :class:`TenantDead`, which the arbiter treats as "not holding the GPU".
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import httpx

from timeslice_verl.agent import tenant_proc
from timeslice_verl.agent.tenant_proc import TenantProcess
from timeslice_verl.log import get_logger
from timeslice_verl.names import split_urls

log = get_logger("agent.tenant")

from timeslice_verl.agent.policy import ASLEEP, AWAKE, DEAD  # noqa: E402,F401  (one definition)


class TenantError(RuntimeError):
    """vLLM answered, but not as the contract says (dev mode off, non-2xx, wrong state)."""


class TenantDead(TenantError):
    """vLLM does not answer at all."""


def _version_tuple(text: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(n) for n in nums) if nums else (0,)


def _flag(payload: Any, key: str) -> bool:
    if isinstance(payload, bool):
        return payload
    if isinstance(payload, dict) and key in payload:
        return bool(payload[key])
    raise TenantError(f"unexpected /{key} answer: {payload!r:.200}")


@dataclass
class TenantInfo:
    url: str
    version: str = "?"
    pause: str = "wait"
    """How requests are held: ``wait`` (/pause?mode=wait, ≥ 0.17) or ``drain`` (older: poll /metrics)."""
    sleep_level: int = 1


class VllmTenant:
    def __init__(
        self, url: str, *, sleep_level: int = 1, request_timeout_s: float = 30.0, drain_timeout_s: float = 600.0,
        pause_mode: str = "keep",
    ) -> None:
        self.info = TenantInfo(url=url.rstrip("/"), sleep_level=sleep_level)
        self.pause_mode = pause_mode
        self.request_timeout_s = request_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.state = AWAKE
        self.process: TenantProcess | None = None
        """The process serving the URL, found at registration: the only one the ladder's kill may stop."""
        self.process_note = "not registered yet"
        """Why :attr:`process` is None."""
        self._client = httpx.AsyncClient(base_url=self.info.url, timeout=request_timeout_s)

    @property
    def url(self) -> str:
        return self.info.url

    note = ""
    """What is wrong while moves still succeed (a group's left-out servers); shown as the tenant's error."""

    async def close(self) -> None:
        await self._client.aclose()

    _waiting: tuple[str, float] | None = None

    def waiting_for(self) -> str:
        """The call this server has not answered yet, and for how long (empty when none is out)."""
        if self._waiting is None:
            return ""
        call, since = self._waiting
        return f"{call} on {self.url} for {time.monotonic() - since:.1f} s"

    async def _request(self, method: str, path: str, *, timeout: float | None = None, **params: Any) -> httpx.Response:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        self._waiting = (f"{method} {path}" + (f"?{query}" if query else ""), time.monotonic())
        try:
            return await self._answer(method, path, timeout=timeout, params=params)
        finally:
            self._waiting = None

    async def _answer(self, method: str, path: str, *, timeout: float | None, params: dict[str, Any]) -> httpx.Response:
        try:
            resp = await self._client.request(method, path, params=params or None, timeout=timeout or self.request_timeout_s)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise TenantDead(f"vLLM at {self.url} does not answer ({method} {path}: {exc.__class__.__name__}: {exc})") from None
        except httpx.TimeoutException:
            raise TenantError(f"vLLM at {self.url}: {method} {path} timed out") from None
        if resp.status_code == 404 and path in ("/sleep", "/wake_up", "/is_sleeping"):
            raise TenantError(
                f"vLLM at {self.url} has no {path}: start it with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode"
            )
        if not resp.is_success:
            raise TenantError(f"vLLM at {self.url}: {method} {path} answered HTTP {resp.status_code}: {resp.text[:300]}")
        return resp

    async def _get_flag(self, path: str) -> bool:
        resp = await self._request("GET", path)
        try:
            payload = resp.json()
        except ValueError:
            raise TenantError(f"vLLM at {self.url}: GET {path} did not answer JSON") from None
        return _flag(payload, path.strip("/"))

    # ------------------------------------------------------------------ registration

    async def register(self) -> TenantInfo:
        """Check the server follows the contract and read its current state."""
        await self._request("GET", "/health")
        try:
            version_resp = await self._request("GET", "/version")
            self.info.version = str(version_resp.json().get("version", "?"))
        except (TenantError, ValueError, AttributeError):
            self.info.version = "?"
        sleeping = await self._get_flag("/is_sleeping")  # 404 here: dev mode or sleep mode is off
        paused_supported, paused = True, False
        try:
            paused = await self._get_flag("/is_paused")
        except TenantError:
            paused_supported = False
        version = _version_tuple(self.info.version)
        self.info.pause = "wait" if paused_supported and (version >= (0, 17) or self.info.version == "?") else "drain"
        # paused but awake (an agent killed between /pause and /sleep): not serving, so reclaim it
        self.state = ASLEEP if (sleeping or paused) else AWAKE
        self.process, self.process_note = await asyncio.to_thread(tenant_proc.find, self.url)
        log.info(
            "tenant vLLM %s at %s: %s, holds requests by %s, sleep level %d",
            self.info.version, self.url, self.state, self.info.pause, self.info.sleep_level,
        )
        return self.info

    async def alive(self, timeout: float | None = None) -> bool:
        """Whether ``/health`` answers 2xx within ``timeout`` (default: 5 s or the request timeout)."""
        try:
            await self._request("GET", "/health", timeout=timeout or min(5.0, self.request_timeout_s))
            return True
        except TenantError:
            return False

    async def observe(self, timeout: float) -> str | None:
        """The state the server says it is in (``awake``, or ``asleep`` when sleeping or paused), or None when it
        does not answer within ``timeout``. A server that refuses the connection raises :class:`TenantDead`."""
        try:
            return await asyncio.wait_for(self._observe(), timeout)
        except asyncio.TimeoutError:
            return None

    async def _observe(self) -> str:
        if await self._get_flag("/is_sleeping"):
            return ASLEEP
        if self.info.pause == "wait" and await self._get_flag("/is_paused"):
            return ASLEEP
        return AWAKE

    # ------------------------------------------------------------------ yield / reclaim

    async def yield_gpu(self) -> float:
        """Hold requests, then sleep. Returns seconds spent; never sleeps a serving engine."""
        t0 = time.perf_counter()
        if await self._get_flag("/is_sleeping"):
            self.state = ASLEEP
            return time.perf_counter() - t0
        if self.info.pause == "wait":
            await self._pause(self.pause_mode, timeout=self.drain_timeout_s + self.request_timeout_s)
        else:
            await self._drain()
        await self._sleep()
        return time.perf_counter() - t0

    async def abort_and_sleep(self) -> float:
        """The reclaim ladder's second step: abort the requests in flight (queued ones are kept), then sleep."""
        t0 = time.perf_counter()
        if self.info.pause == "wait":
            await self._pause("abort")
        await self._sleep()
        return time.perf_counter() - t0

    async def _pause(self, mode: str, *, timeout: float | None = None) -> None:
        try:
            await self._request("POST", "/pause", timeout=timeout, mode=mode)
        except TenantError as exc:
            if mode != "keep" or "HTTP 422" not in str(exc):
                raise
            log.warning("vLLM at %s does not take /pause?mode=keep: pausing with mode=wait (in-flight requests finish "
                        "first) from now on", self.url)
            self.pause_mode = "wait"
            await self._request("POST", "/pause", timeout=timeout, mode="wait")
        if not await self._get_flag("/is_paused"):
            raise TenantError(f"vLLM at {self.url} accepted /pause but reports is_paused=false: not sleeping it")

    async def _sleep(self) -> None:
        try:
            await self._request("POST", "/sleep", level=self.info.sleep_level, mode="keep")
        except TenantError as exc:
            if "HTTP 422" not in str(exc):
                raise
            log.warning("vLLM at %s does not take /sleep?mode=keep: requests queued while paused may be aborted", self.url)
            await self._request("POST", "/sleep", level=self.info.sleep_level)
        if not await self._get_flag("/is_sleeping"):
            raise TenantError(f"vLLM at {self.url} accepted /sleep but reports is_sleeping=false")
        self.state = ASLEEP

    async def _drain(self) -> None:
        """vLLM < 0.17: wait until nothing runs or waits (two quiet reads in a row)."""
        deadline = time.monotonic() + self.drain_timeout_s
        quiet = 0
        while time.monotonic() < deadline:
            resp = await self._request("GET", "/metrics")
            busy = 0.0
            for line in resp.text.splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                    try:
                        busy += float(line.rsplit(" ", 1)[1])
                    except ValueError:
                        continue
            quiet = quiet + 1 if busy == 0 else 0
            if quiet >= 2:
                return
            await asyncio.sleep(0.05)
        raise TenantError(f"vLLM at {self.url} did not drain within {self.drain_timeout_s:g} s: not sleeping it")

    async def reclaim(self) -> float:
        """Wake up, then resume admitting requests. Returns seconds spent."""
        t0 = time.perf_counter()
        await self._request("POST", "/wake_up")
        if await self._get_flag("/is_sleeping"):
            raise TenantError(f"vLLM at {self.url} accepted /wake_up but still reports is_sleeping=true")
        if self.info.pause == "wait":
            await self._request("POST", "/resume")
        self.state = AWAKE
        return time.perf_counter() - t0


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
        self.info = TenantInfo(url=",".join(m.url for m in self.members), sleep_level=self.members[0].info.sleep_level)
        self.state = AWAKE
        self.dead: set[str] = set()
        """URLs of the servers that did not answer the last move."""

    @property
    def url(self) -> str:
        return self.info.url

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
        from timeslice_verl.agent.ladder import STEPS, Climb, TenantKilled

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

    async def yield_gpu(self) -> float:
        t0 = time.perf_counter()
        await self._each("yield", lambda m: m.yield_gpu())
        self.state = ASLEEP
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


def make_tenant(url: str, **kwargs: Any) -> VllmTenant | TenantGroup:
    """One server, or a group for a comma-separated list of URLs."""
    urls = split_urls(url)
    return VllmTenant(urls[0], **kwargs) if len(urls) == 1 else TenantGroup(urls, **kwargs)
