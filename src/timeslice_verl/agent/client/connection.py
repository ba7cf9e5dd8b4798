"""The agent client: what the bundled agent plugin, the CLI, the batch service and the demo use to talk to the agent.

Synchronous and thread-safe, with several requests in flight on one connection (replies carry the request's
``id``): the trainer's thread may release while the way back's acquire still waits. The connection is kept for
the job's lifetime — the agent releases whatever a connection holds when it closes, which is how a crashed
trainer gives the GPU back. A reader thread sees the agent go away at once; it reconnects (for as long as
the client has jobs, however long the agent's restart takes) and first tells the new agent which jobs are
this client's and whether it holds the GPU (``attach``), so a trainer in the middle of a step is never taken
for gone. Requests still waiting for a reply are sent again on the new connection (every operation is
idempotent on the agent side); one that finds no agent within ``connect_timeout_s`` fails ``unreachable``.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timeslice_verl.agent.client.protocol import MAX_REQUEST_BYTES, PROTOCOL_VERSION, peer_credentials
from timeslice_verl.backoff import Backoff
from timeslice_verl.log import get_logger
from timeslice_verl.names import SwapMode

log = get_logger("agent.client")

RECONNECT_MAX_S = 1.0
RECONNECT = Backoff(0.05, RECONNECT_MAX_S)
"""The longest pause between two tries to reach an agent that went away."""


class AgentError(RuntimeError):
    """The agent refused a request (``code`` from the protocol) or could not be reached (``unreachable``)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{message} [{code}]")


@dataclass
class _Request:
    op: str
    payload: bytes
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    error: AgentError | None = None
    lost_at: float | None = None
    """When the connection it was sent on went away (it is sent again on the next one)."""

    def finish(self, reply: dict[str, Any] | None = None, error: AgentError | None = None) -> None:
        self.reply, self.error = reply, error
        self.done.set()


class AgentClient:
    def __init__(self, path: str | Path, *, connect_timeout_s: float = 30.0, client: str = "timeslice-verl") -> None:
        self.path = str(path)
        self.connect_timeout_s = connect_timeout_s
        self.client = client
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        """Guards the connection, the requests in flight and the jobs; never held while blocking on the socket."""
        self._send_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pending: dict[int, _Request] = {}
        self._jobs: dict[str, bool] = {}
        """The jobs this client acted for, and whether it holds the GPU for each (what ``attach`` tells)."""
        self._closed = False
        self._reconnecting = False
        self._was_connected = False

    # ------------------------------------------------------------------ connection

    def _open(self) -> socket.socket:
        """A connection checked to be served by our user (or root); raises OSError or AgentError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            self._check_server(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect(self, deadline: float | None) -> bool:
        """Connect; True once connected. ``deadline``: raise ``unreachable`` past it; None: keep trying for as long
        as the client has jobs or requests (the reconnect after the agent went away). One attempt at a time, and
        no lock held between attempts: a caller with a deadline of its own is never kept waiting behind it."""
        delay, last = RECONNECT.first_s, None
        while True:
            with self._lock:
                if self._sock is not None:
                    return True
                if self._closed or (deadline is None and not (self._jobs or self._pending)):
                    return False
            self._expire()
            with self._connect_lock:
                with self._lock:
                    if self._sock is not None:
                        return True
                try:
                    sock = self._open()
                except OSError as exc:
                    last = exc
                else:
                    self._adopt(sock)
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                raise AgentError("unreachable", f"no timeslice agent answers on {self.path} ({last}); start one "
                                 "with `timeslice-verl agent`")
            time.sleep(delay)
            delay = RECONNECT.next(delay)

    def _adopt(self, sock: socket.socket) -> None:
        """Make ``sock`` the connection: tell the agent our jobs first, then send what waits for a reply again."""
        with self._lock:
            self._sock = sock
            again, self._was_connected = self._was_connected, True  # the first connection has nothing to reattach
            attach = [(next(self._ids), job, holding) for job, holding in self._jobs.items()] if again else []
            resend = [r.payload for _, r in sorted(self._pending.items())]
            for r in self._pending.values():
                r.lost_at = None
        threading.Thread(target=self._read, args=(sock,), daemon=True, name="timeslice-agent-reader").start()
        for req_id, job, holding in attach:  # the new agent learns at once that these jobs are ours
            msg = {"v": PROTOCOL_VERSION, "id": req_id, "op": "attach", "job": job, "holding": holding}
            self._send(sock, json.dumps(msg).encode() + b"\n")
        if attach:
            log.warning("reattached job(s) %s to the agent on %s", ", ".join(j for _, j, _ in attach), self.path)
        for payload in resend:
            self._send(sock, payload)

    def _send(self, sock: socket.socket, payload: bytes) -> None:
        try:
            with self._send_lock:
                sock.sendall(payload)
        except OSError:
            self._lost(sock)  # the request is sent again once reconnected

    def _expire(self) -> None:
        """Fail the requests that have waited ``connect_timeout_s`` for a lost agent to come back."""
        now = time.monotonic()
        with self._lock:
            expired = [i for i, r in self._pending.items() if r.lost_at is not None and now - r.lost_at >= self.connect_timeout_s]
            requests = [self._pending.pop(i) for i in expired]
        for r in requests:
            r.finish(error=AgentError("unreachable", f"lost the agent on {self.path} during {r.op!r}; it did not come "
                                      f"back within {self.connect_timeout_s:g} s"))

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

    def _read(self, sock: socket.socket) -> None:
        """The reader of one connection: hands each reply to its request; at the end, reconnects."""
        buf = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > 64 * MAX_REQUEST_BYTES and b"\n" not in buf:
                    break  # an oversized reply: this is no agent we can talk to
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._deliver(line)
        except (OSError, ValueError):
            pass
        self._lost(sock)

    def _deliver(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        with self._lock:
            if msg.get("id") is None:  # about the connection (refused, busy, too large): every request learns it
                waiting, self._pending = list(self._pending.values()), {}
            else:
                request = self._pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
                waiting = [request] if request is not None else []
        for request in waiting:
            request.finish(reply=msg)

    def _lost(self, sock: socket.socket) -> None:
        with self._lock:
            if self._sock is not sock:
                return
            self._sock = None
            try:
                sock.close()
            except OSError:
                pass
            now = time.monotonic()
            for r in self._pending.values():
                r.lost_at = r.lost_at or now
            if self._closed or self._reconnecting or not (self._jobs or self._pending):
                return
            self._reconnecting = True
        log.warning("lost the agent on %s: reconnecting", self.path)
        threading.Thread(target=self._reconnect, daemon=True, name="timeslice-agent-reconnect").start()

    def _reconnect(self) -> None:
        """The reader's reconnect: until connected again, or until the client has nothing left to wait for."""
        while True:
            try:
                self._connect(None)
            except AgentError as exc:  # a socket now served by someone else: nothing more to send there
                log.error("could not reattach to the agent on %s: %s", self.path, exc)
                with self._lock:
                    failed, self._pending = list(self._pending.values()), {}
                for r in failed:
                    r.finish(error=exc)
            with self._lock:
                if self._sock is not None or self._closed or not (self._jobs or self._pending):
                    self._reconnecting = False
                    return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            pending, self._pending = list(self._pending.values()), {}
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for r in pending:
            r.finish(error=AgentError("closed", f"the client was closed during {r.op!r}"))

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def call(self, op: str, *, reply_timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request; return its ``result`` or raise :class:`AgentError`."""
        req_id = next(self._ids)
        request = _Request(op, json.dumps({"v": PROTOCOL_VERSION, "id": req_id, "op": op, **args}).encode() + b"\n")
        with self._lock:
            if self._closed:
                self._closed = False  # a closed client may be used again: it reconnects (tools do)
            self._pending[req_id] = request
            sock = self._sock
        try:
            if sock is None:
                self._connect(time.monotonic() + self.connect_timeout_s)  # sends what is pending, this one too
            else:
                self._send(sock, request.payload)
            if not request.done.wait(reply_timeout_s):
                raise AgentError("timeout", f"the agent did not answer {op!r} within {reply_timeout_s:g} s")
        finally:
            with self._lock:
                self._pending.pop(req_id, None)
        if request.error is not None:
            raise request.error
        msg = request.reply or {}
        if not msg.get("ok"):
            err = msg.get("error") or {}
            raise AgentError(str(err.get("code", "error")), str(err.get("message", msg)))
        return msg.get("result") or {}

    def _job_call(self, op: str, job: str, holding: bool | None, **kwargs: Any) -> dict[str, Any]:
        """A request that acts for ``job``: the client keeps the job to reattach it (and whether it holds)."""
        with self._lock:
            self._jobs.setdefault(job, False)
        result = self.call(op, job=job, **kwargs)
        with self._lock:
            if holding is None:
                pass
            elif op == "release" and kwargs.get("done"):
                self._jobs.pop(job, None)
            else:
                self._jobs[job] = holding
        return result

    # ------------------------------------------------------------------ operations

    def hello(self) -> dict[str, Any]:
        return self.call("hello", client=self.client, reply_timeout_s=10)

    def status(self) -> dict[str, Any]:
        return self.call("status", reply_timeout_s=10)

    def acquire(self, job: str, *, timeout_s: float | None = None, pids: list[int] | None = None) -> dict[str, Any]:
        """Block until ``job``'s processes own the GPU."""
        args: dict[str, Any] = {}
        if timeout_s:
            args["timeout_s"] = timeout_s
        if pids:
            args["pids"] = list(pids)
        return self._job_call("acquire", job, True, reply_timeout_s=(timeout_s + 30) if timeout_s else None, **args)

    def release(
        self, job: str, *, wait: bool = False, done: bool = False, swap: SwapMode = SwapMode.checkpoint,
        parked: list[dict[str, int]] | None = None,
    ) -> dict[str, Any]:
        """Give the GPU back; ``done``: the job has ended, so forget it instead of freezing its exiting processes.
        ``swap`` other than ``checkpoint``: the workers parked their tensors or keep them (``parked``: one
        ``{"pid", "parked", "kept"}`` per worker), so the agent locks (and checkpoints) only what is left."""
        args: dict[str, Any] = {"wait": wait}
        if done:
            args["done"] = True
        swap = SwapMode(swap)
        if swap is not SwapMode.checkpoint:
            args["swap"] = swap.value
            args["parked"] = [{"pid": int(r["pid"]), "parked": int(r["parked"]), "kept": int(r["kept"])} for r in parked or []]
        return self._job_call("release", job, False, reply_timeout_s=None if wait else 30, **args)

    def prepare(self, job: str, *, ttl_s: float | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {}
        if ttl_s:
            args["ttl_s"] = ttl_s
        return self._job_call("prepare", job, None, reply_timeout_s=30, **args)

    def register_pids(self, job: str, pids: list[int]) -> dict[str, Any]:
        return self._job_call("register_pids", job, None, pids=list(pids), reply_timeout_s=30)

    def register_tenant(self, urls: list[str], *, sleep_level: int = 1, **supervisor: Any) -> dict[str, Any]:
        """Register the tenant: its addresses, one vLLM per GPU (a list, also for one)."""
        return self.call("register_tenant", urls=list(urls), sleep_level=sleep_level, reply_timeout_s=120, **supervisor)

    def unregister_tenant(self) -> dict[str, Any]:
        return self.call("unregister_tenant", reply_timeout_s=120)

    def watch_owner(self, seen: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Block until the GPU's owner is no longer ``seen`` (or ``timeout_s``); ``{"owner", "tenant"}``."""
        return self.call("watch_owner", seen=seen, timeout_s=timeout_s, reply_timeout_s=timeout_s + 30)


def wait_for_agent(path: str | Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """Block until an agent answers on ``path``; its ``hello``."""
    with AgentClient(path, connect_timeout_s=timeout_s) as client:
        return client.hello()


__all__ = ["AgentClient", "AgentError", "wait_for_agent"]
