"""The policy tenant: a vLLM beside the trainer that holds one version of the actor's weights at a time.

Weights go in through vLLM's weight-transfer API (vLLM ≥ 0.23 with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "ipc"}'``; for handles sent over HTTP also
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which makes the server's own port as trusted as the user's GPU):
``/init_weight_transfer_engine`` once, then per version ``/pause?mode=wait`` → ``/start_weight_update`` →
``/update_weights`` (one call per chunk) → ``/finish_weight_update`` → ``/resume``. vLLM keeps no version: this
client does, and a push is refused while the tenant holds requests, so one validation never spans two versions.

:func:`~timeslice_verl.weights.ipc_updates` turns named CUDA tensors into ``update_info`` bodies of IPC handles
(the tenant on the same GPU opens them: no copy through the host); the tensors must stay alive until the push
returns, and a park must not move them meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

import httpx

from timeslice_verl.batch.concurrency import parse_metrics
from timeslice_verl.log import get_logger
from timeslice_verl.weights import Update, WeightsError, ipc_updates

log = get_logger("validate")

PUSH_TIMEOUT_S = 300.0
"""One call of a push (vLLM's own trainer-side sender waits as long)."""


class PolicyError(WeightsError):
    """The policy tenant refused or failed a call; the message names which and why."""


class PolicyBusy(PolicyError):
    """The tenant holds requests: a push now would mix two versions in one validation."""


class PolicyAsleep(PolicyBusy):
    """The tenant sleeps (the trainer holds the GPU): its weights are off the GPU and an update would fail inside
    vLLM, so the version waits for the tenant's next valley."""


@dataclass(frozen=True)
class Push:
    """What one push moved and how long it took."""

    version: int
    tensors: int
    bytes: int
    seconds: float


class PolicyTenant:
    """One vLLM serving the policy, and the version of the weights it holds (None: unknown, e.g. a push failed
    midway — no validation runs on it until the next push completes)."""

    def __init__(self, url: str, *, timeout_s: float = PUSH_TIMEOUT_S, client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.version: int | None = None
        self._http = client or httpx.Client(base_url=self.url, timeout=timeout_s)
        self._initialised = False

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> None:
        try:
            resp = self._http.post(path, json=body, params=params or None)
        except httpx.HTTPError as exc:
            raise PolicyError(f"policy tenant {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 300:
            raise PolicyError(f"policy tenant {self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")

    def busy(self) -> int:
        """Requests the tenant runs or holds waiting (vLLM's own gauges)."""
        try:
            sample = parse_metrics(self._http.get("/metrics").text)
        except httpx.HTTPError as exc:
            raise PolicyError(f"policy tenant {self.url}/metrics: {type(exc).__name__}: {exc}") from exc
        if sample is None:
            raise PolicyError(f"policy tenant {self.url}/metrics has no request gauges: is it a vLLM?")
        return int(sample.running + sample.waiting)

    def asleep(self) -> bool:
        """Whether vLLM sleeps now (``/is_sleeping``, a dev-mode route like the weight-transfer ones)."""
        try:
            resp = self._http.get("/is_sleeping")
            resp.raise_for_status()
            return bool(resp.json()["is_sleeping"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise PolicyError(f"policy tenant {self.url}/is_sleeping: {type(exc).__name__}: {exc}") from exc

    def init(self, init_info: dict[str, Any] | None = None) -> None:
        """Once per tenant process (IPC needs no init info; NCCL its rendezvous)."""
        self._post("/init_weight_transfer_engine", {"init_info": init_info or {}})
        self._initialised = True

    def push(self, version: int, updates: Iterable[Update]) -> Push:
        """Load ``version`` (``updates``: e.g. from :func:`ipc_updates`). Refused while the tenant holds requests; a
        failure midway leaves the version unknown."""
        if not self._initialised:
            self.init()
        if self.asleep():
            raise PolicyAsleep(f"policy tenant {self.url} is asleep: version {version} waits for its valley")
        held = self.busy()
        if held:
            raise PolicyBusy(f"policy tenant {self.url} holds {held} request(s): version {version} waits for them")
        t0, tensors, size = time.monotonic(), 0, 0
        self._post("/pause", mode="wait")
        try:
            self.version = None
            self._post("/start_weight_update", {"is_checkpoint_format": True, "timeslice_version": version})
            try:
                for update in updates:
                    self._post("/update_weights", {"update_info": update.info})
                    tensors += len(update.info.get("names", ()))
                    size += update.bytes
            except BaseException:
                self._end_update()
                raise
            self._post("/finish_weight_update", {})
            self.version = version
        finally:
            self._post("/resume")
        out = Push(version, tensors, size, time.monotonic() - t0)
        log.info("policy tenant %s: version %d loaded, %d tensors, %.2f GB in %.2f s", self.url, version, tensors,
                 size / 1e9, out.seconds)
        return out


    def _end_update(self) -> None:
        """Close an update that failed midway (its weights half new: the version stays unknown), so the next push
        can start one."""
        try:
            self._post("/finish_weight_update", {})
        except PolicyError as exc:
            log.warning("policy tenant %s: the failed update could not be closed: %s", self.url, exc)


__all__ = ["PUSH_TIMEOUT_S", "PolicyAsleep", "PolicyBusy", "PolicyError", "PolicyTenant", "Push", "Update", "ipc_updates"]
