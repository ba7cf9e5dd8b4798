"""The vLLM tenant: the batch server that borrows the GPU while no trainer job holds it.

Contract (docs/architecture.md §5), server started with ``VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode``:

* yield   = ``POST /pause?mode=keep`` (vLLM ≥ 0.17: in-flight requests stop where they are and resume
  after the wake-up; ``mode=wait`` lets them finish first; older: wait until ``/metrics`` shows no
  running or waiting request) → ``POST /sleep?level=N&mode=keep``
  (``/sleep`` pauses again with its own mode, ``abort`` by default, which would fail the requests
  queued since the pause: ``keep`` holds them until ``/resume``); a yield that overruns the reclaim deadline goes down the ladder
  (:mod:`~timeslice_verl.agent.tenant.ladder`: ``/pause?mode=abort``, then the tenant's processes are stopped);
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
from typing import Any

import httpx

from timeslice_verl.agent.tenant import proc as tenant_proc
from timeslice_verl.agent.tenant.proc import TenantProcess
from timeslice_verl.log import get_logger

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

    @property
    def urls(self) -> list[str]:
        """The tenant's addresses (one server: its own), what the agent records and compares."""
        return [self.info.url]

    @property
    def name(self) -> str:
        """How logs and the journal name it."""
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
        self.process, self.process_note = await asyncio.to_thread(tenant_proc.rediscover, self.process, self.url)
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

    held = False
    """Paused and not asleep (a pause-only yield, :mod:`~timeslice_verl.agent.tenant.hold`): its memory is still on the GPU."""

    async def yield_gpu(self, sleep: bool = True) -> float:
        """Hold requests, then sleep (``sleep=False``: hold only). Returns seconds spent; never sleeps a serving
        engine."""
        t0 = time.perf_counter()
        if not sleep:
            return await self._hold(t0)
        if await self._get_flag("/is_sleeping"):
            self.state, self.held = ASLEEP, False
            return time.perf_counter() - t0
        if self.info.pause == "wait":
            await self._pause(self.pause_mode, timeout=self.drain_timeout_s + self.request_timeout_s)
        else:
            await self._drain()
        await self._sleep()
        return time.perf_counter() - t0

    async def _hold(self, t0: float) -> float:
        """A pause-only yield: one request, ``/pause`` (vLLM answers it once the engine stopped scheduling), since the
        trainer waits for it (a busy API server takes tenths of a second to answer). Nothing is read back here:
        the reclaim, off the trainer's path, checks whether the server was put to sleep meanwhile."""
        if self.info.pause != "wait":
            raise TenantError(f"vLLM {self.info.version} at {self.url} has no /pause: it can only yield by sleeping")
        await self._pause(self.pause_mode, timeout=self.drain_timeout_s + self.request_timeout_s, check=False)
        self.state, self.held = ASLEEP, True
        return time.perf_counter() - t0

    async def sleep_held(self) -> float:
        """Put a tenant held awake to sleep (its requests stay held): the trainer needs its memory after all."""
        t0 = time.perf_counter()
        if self.held:
            await self._sleep()
        return time.perf_counter() - t0

    async def abort_and_sleep(self) -> float:
        """The reclaim ladder's second step: abort the requests in flight (queued ones are kept), then sleep."""
        t0 = time.perf_counter()
        if self.info.pause == "wait":
            await self._pause("abort")
        await self._sleep()
        return time.perf_counter() - t0

    async def _pause(self, mode: str, *, timeout: float | None = None, check: bool = True) -> None:
        """``/pause``; with ``keep``, ``clear_cache=false``: vLLM clears its caches after a pause by default, which
        preempts every held request (their KV cache dropped and recomputed at the resume, which costs the first tenths
        of a second of every valley when hundreds of long answers are held)."""
        keep = {"clear_cache": "false"} if mode == "keep" else {}
        try:
            await self._request("POST", "/pause", timeout=timeout, mode=mode, **keep)
        except TenantError as exc:
            if mode != "keep" or "HTTP 422" not in str(exc):
                raise
            log.warning("vLLM at %s does not take /pause?mode=keep: pausing with mode=wait (in-flight requests finish "
                        "first) from now on", self.url)
            self.pause_mode = "wait"
            await self._request("POST", "/pause", timeout=timeout, mode="wait")
        if check and not await self._get_flag("/is_paused"):
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
        self.state, self.held = ASLEEP, False

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
        """Wake up (unless held awake), then resume admitting requests. Returns seconds spent."""
        t0 = time.perf_counter()
        # held awake: only the pause to undo, unless something put the server to sleep since (the hold reads nothing)
        if not self.held or await self._get_flag("/is_sleeping"):
            await self._request("POST", "/wake_up")
            if await self._get_flag("/is_sleeping"):
                raise TenantError(f"vLLM at {self.url} accepted /wake_up but still reports is_sleeping=true")
        if self.info.pause == "wait":
            await self._request("POST", "/resume")
        self.state, self.held = AWAKE, False
        return time.perf_counter() - t0
