"""The stand-in vLLM's weight transfer: vLLM's four routes, checked as vLLM checks them, and the version it holds.

vLLM (≥ 0.23, ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config``) takes new weights in four calls:
``POST /init_weight_transfer_engine {"init_info": …}`` once, then per update ``/start_weight_update``,
``/update_weights {"update_info": {names, dtype_names, shapes, ipc_handles | ipc_handles_pickled, …}}`` (one or
more) and ``/finish_weight_update``. vLLM has no weight version; the stand-in counts one (``timeslice_version`` in
the start call's body, vLLM ignores the key, else the next integer) and tags every answer with the version it
generated under — or ``"mixed"`` when an update landed while it generated, which a policy tenant must never let
happen (its pushes wait for a validation's end). The tensors themselves are not loaded (the stand-in has none).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


class TransferRefused(Exception):
    """A call vLLM would refuse: (HTTP status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Weights:
    """What the stand-in holds and what was pushed into it (under its own lock)."""

    version: int = 0
    initialised: bool = False
    pending: int | None = None
    """The version an update under way will hold once finished."""
    tensors: int = 0
    """Tensors received by the update under way."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Each finished update: its version, tensors, and how many requests were generating then."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def init(self, body: dict[str, Any]) -> None:
        if not isinstance(body.get("init_info"), dict):
            raise TransferRefused(400, "Missing 'init_info' in request body")
        with self.lock:
            self.initialised = True

    def start(self, body: dict[str, Any]) -> None:
        with self.lock:
            if not self.initialised:
                raise TransferRefused(500, "weight transfer engine not initialised: call /init_weight_transfer_engine")
            if self.pending is not None:
                raise TransferRefused(500, "a weight update is already under way")
            version = body.get("timeslice_version")
            self.pending = int(version) if isinstance(version, int) and not isinstance(version, bool) else self.version + 1
            self.tensors = 0

    def update(self, body: dict[str, Any]) -> None:
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise TransferRefused(400, "Missing 'update_info' in request body")
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise TransferRefused(400, "update_info needs names, dtype_names and shapes (lists)")
        if not len(names) == len(dtypes) == len(shapes):
            raise TransferRefused(400, f"`dtype_names` and `shapes` should be of the same size as `names`: got "
                                       f"{len(dtypes)}, {len(shapes)} and {len(names)}")
        if (info.get("ipc_handles") is None) == (info.get("ipc_handles_pickled") is None):
            raise TransferRefused(400, "Either `ipc_handles` or `ipc_handles_pickled` must be provided (one)")
        with self.lock:
            if self.pending is None:
                raise TransferRefused(500, "no weight update under way: call /start_weight_update first")
            self.tensors += len(names)

    def finish(self, generating: int) -> None:
        with self.lock:
            if self.pending is None:
                raise TransferRefused(500, "no weight update under way: call /start_weight_update first")
            self.version, self.pending = self.pending, None
            self.history.append({"version": self.version, "tensors": self.tensors, "generating": generating})

    def held(self) -> int:
        with self.lock:
            return self.version

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"version": self.version, "updating": self.pending is not None, "updates": list(self.history)}


ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")


def route(weights: Weights, path: str, body: dict[str, Any], generating: int) -> tuple[int, dict[str, Any]]:
    """One of the four calls: (status, body) as vLLM answers it."""
    try:
        if path == "/init_weight_transfer_engine":
            weights.init(body)
            return 200, {"message": "Weight transfer initialized"}
        if path == "/start_weight_update":
            weights.start(body)
            return 200, {"message": "Weight update started"}
        if path == "/update_weights":
            weights.update(body)
            return 200, {"message": "Weights updated"}
        weights.finish(generating)
        return 200, {"message": "Weight update finished"}
    except TransferRefused as exc:
        return exc.status, {"detail": str(exc)}


__all__ = ["ROUTES", "TransferRefused", "Weights", "route"]
