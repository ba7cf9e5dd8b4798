"""The agent client: what the bundled agent plugin, the CLI and the demo use to talk to the agent.

Synchronous and thread-safe (one request at a time per client). It keeps one connection open for
the job's lifetime — the agent releases whatever a connection holds when it closes, which is how a
crashed trainer gives the GPU back — and reconnects (for up to ``connect_timeout_s``) when the
agent restarts, re-sending the request; every operation is idempotent on the agent side.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from timeslice_verl.agent.protocol import MAX_REQUEST_BYTES, PROTOCOL_VERSION, peer_credentials
from timeslice_verl.log import get_logger

log = get_logger("agent.client")


class AgentError(RuntimeError):
    """The agent refused a request (``code`` from the protocol) or could not be reached (``unreachable``)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{message} [{code}]")


class AgentClient:
    def __init__(self, path: str | Path, *, connect_timeout_s: float = 30.0, client: str = "timeslice-verl") -> None:
        self.path = str(path)
        self.connect_timeout_s = connect_timeout_s
        self.client = client
        self._sock: socket.socket | None = None
        self._buf = b""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ connection

    def _connect(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        delay = 0.05
        last: Exception | None = None
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                last = exc
            else:
                try:
                    self._check_server(sock)
                except AgentError:
                    sock.close()
                    raise
                self._sock, self._buf = sock, b""
                return
            if time.monotonic() >= deadline:
                raise AgentError(
                    "unreachable",
                    f"no timeslice agent answers on {self.path} ({last}); start one with `timeslice-verl agent`",
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _check_server(self, sock: socket.socket) -> None:
        """Talk only to an agent of our own user (or root): a socket planted by someone else is refused."""
        trusted = (os.getuid(), 0)
        try:
            owner = os.stat(os.path.dirname(os.path.abspath(self.path)) or ".").st_uid
        except OSError as exc:
            raise AgentError("untrusted", f"cannot check the agent's directory for {self.path}: {exc}") from None
        if owner not in trusted:
            raise AgentError("untrusted", f"the directory of {self.path} belongs to uid {owner}, not to you: refusing to use it")
        _pid, uid = peer_credentials(sock)
        if uid is None:
            raise AgentError("untrusted", f"cannot tell who serves {self.path}: refusing to use it")
        if uid not in trusted:
            raise AgentError("untrusted", f"{self.path} is served by uid {uid}, not by you or root: refusing to use it")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _roundtrip(self, payload: bytes, req_id: int, timeout_s: float | None) -> dict[str, Any]:
        assert self._sock is not None
        self._sock.settimeout(timeout_s)
        self._sock.sendall(payload)
        while True:
            while b"\n" not in self._buf:
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("agent closed the connection")
                self._buf += chunk
                if len(self._buf) > 64 * MAX_REQUEST_BYTES:
                    raise ConnectionResetError("oversized response")
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if msg.get("id") in (req_id, None):
                return msg

    def call(self, op: str, *, reply_timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request; return its ``result`` or raise :class:`AgentError`."""
        with self._lock:
            req_id = next(self._ids)
            payload = json.dumps({"v": PROTOCOL_VERSION, "id": req_id, "op": op, **args}).encode() + b"\n"
            for attempt in (1, 2):
                if self._sock is None:
                    self._connect()
                try:
                    msg = self._roundtrip(payload, req_id, reply_timeout_s)
                    break
                except socket.timeout:
                    self._drop()
                    raise AgentError("timeout", f"the agent did not answer {op!r} within {reply_timeout_s:g} s") from None
                except (ConnectionError, OSError, json.JSONDecodeError) as exc:
                    self._drop()
                    if attempt == 2:
                        raise AgentError("unreachable", f"lost the agent on {self.path} during {op!r}: {exc}") from None
                    log.warning("lost the agent during %s (%s): reconnecting", op, exc)
        if not msg.get("ok"):
            err = msg.get("error") or {}
            raise AgentError(str(err.get("code", "error")), str(err.get("message", msg)))
        return msg.get("result") or {}

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    # ------------------------------------------------------------------ operations

    def hello(self) -> dict[str, Any]:
        return self.call("hello", client=self.client, reply_timeout_s=10)

    def status(self) -> dict[str, Any]:
        return self.call("status", reply_timeout_s=10)

    def acquire(self, job: str, *, timeout_s: float | None = None, pids: list[int] | None = None) -> dict[str, Any]:
        """Block until ``job``'s processes own the GPU."""
        args: dict[str, Any] = {"job": job}
        if timeout_s:
            args["timeout_s"] = timeout_s
        if pids:
            args["pids"] = list(pids)
        return self.call("acquire", reply_timeout_s=(timeout_s + 30) if timeout_s else None, **args)

    def release(
        self, job: str, *, wait: bool = False, done: bool = False, swap: str = "checkpoint",
        parked: list[dict[str, int]] | None = None,
    ) -> dict[str, Any]:
        """Give the GPU back; ``done``: the job has ended, so forget it instead of freezing its exiting processes.
        ``swap`` ``park``/``park+checkpoint``: the workers parked their tensors (``parked``: one
        ``{"pid", "parked", "kept"}`` per worker), so the agent locks (and checkpoints) only what is left."""
        args: dict[str, Any] = {"job": job, "wait": wait}
        if done:
            args["done"] = True
        if swap != "checkpoint":
            args["swap"] = swap
            args["parked"] = [{"pid": int(r["pid"]), "parked": int(r["parked"]), "kept": int(r["kept"])} for r in parked or []]
        return self.call("release", reply_timeout_s=None if wait else 30, **args)

    def prepare(self, job: str, *, ttl_s: float | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"job": job}
        if ttl_s:
            args["ttl_s"] = ttl_s
        return self.call("prepare", reply_timeout_s=30, **args)

    def register_pids(self, job: str, pids: list[int]) -> dict[str, Any]:
        return self.call("register_pids", job=job, pids=list(pids), reply_timeout_s=30)

    def register_tenant(self, url: str, *, sleep_level: int = 1) -> dict[str, Any]:
        return self.call("register_tenant", url=url, sleep_level=sleep_level, reply_timeout_s=120)

    def unregister_tenant(self) -> dict[str, Any]:
        return self.call("unregister_tenant", reply_timeout_s=120)


def wait_for_agent(path: str | Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """Block until an agent answers on ``path``; its ``hello``."""
    with AgentClient(path, connect_timeout_s=timeout_s) as client:
        return client.hello()


__all__ = ["AgentClient", "AgentError", "wait_for_agent"]
