"""The agent daemon: a Unix-socket server in front of the arbiter.

The socket lives in a directory only its user can enter (0700) and is itself 0600; each connection's
peer credentials (``SO_PEERCRED``) are checked against the agent's user. A connection carries one
client (a trainer's agent plugin, the CLI); what it holds is released when it closes. SIGTERM and
SIGINT stop the agent cleanly: no new requests, frozen jobs thawed, vLLM woken.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import json
import logging
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any

from timeslice_verl import __version__
from timeslice_verl.agent import protocol
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.ladder import SHORT_DEADLINE_S, budgets
from timeslice_verl.agent.gpu import open_probe
from timeslice_verl.agent.host import (  # noqa: F401 (AgentStartError, MAX_CONNECTIONS: re-exported)
    BACKLOG,
    MAX_CONNECTIONS,
    AgentStartError,
    _QuietAccept,
    connection_limit,
    take_gpu_locks,
    take_instance_lock,
)
from timeslice_verl.agent.protocol import ErrorCode, ProtocolError, peer_credentials
from timeslice_verl.agent.state import StateStore
from timeslice_verl.agent.freeze import BackendUnavailable, make_backend
from timeslice_verl.config import TimesliceSettings, socket_path, state_path
from timeslice_verl.log import get_logger

log = get_logger("agent")


MAX_IN_FLIGHT = 32
"""Requests of one connection being served at a time; its further requests wait unread."""


def _op(line: bytes) -> Any:
    """The request's ``op``, or None (parse errors are answered by the request's own task)."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return data.get("op") if isinstance(data, dict) else None


READ_ONLY = frozenset({"hello", "status"})
"""Requests that change nothing the state file records."""


class AgentServer:
    def __init__(self, settings: TimesliceSettings, arbiter: Arbiter, path: Path) -> None:
        self.settings = settings
        self.arbiter = arbiter
        self.path = path
        self._ids = itertools.count(1)
        self._stop = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.max_connections = MAX_CONNECTIONS
        self._handlers: set[asyncio.Task] = set()

    def info(self) -> dict[str, Any]:
        backend = self.arbiter.backend
        return {
            "agent_version": __version__,
            "protocol": protocol.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "backend": backend.name,
            "backend_description": backend.description,
            "frees_gpu_memory": backend.frees_gpu_memory,
            "gpus": list(self.settings.agent.gpus),
            "socket": str(self.path),
            "started": self.arbiter.started,
            "settings": self.running_settings(),
        }

    def running_settings(self) -> dict[str, Any]:
        """The ``agent`` and ``tenant`` sections this agent runs with (as the trainer would write them)."""
        out: dict[str, Any] = {}
        for name in ("agent", "tenant"):
            part = dataclasses.asdict(getattr(self.settings, name))
            out[name] = {k: (str(v) if isinstance(v, enum.Enum) else v) for k, v in part.items()}
        return out

    # ------------------------------------------------------------------ socket

    def claim_path(self) -> None:
        """Fail early if another agent serves this socket; remove a stale one."""
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = parent.stat()
        if st.st_uid != os.getuid():
            raise AgentStartError(f"timeslice.agent.socket: directory {parent} belongs to uid {st.st_uid}, not to you")
        if st.st_mode & 0o022:
            raise AgentStartError(f"timeslice.agent.socket: directory {parent} is writable by others; use a private directory")
        if self.path.exists() or self.path.is_symlink():
            mode = self.path.lstat().st_mode
            if not stat.S_ISSOCK(mode):  # never delete what is not a socket (we did not create it)
                raise AgentStartError(f"timeslice.agent.socket: {self.path} exists and is not a socket; move it away "
                                      "or choose another path")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # a stale socket of a dead agent
            else:
                raise AgentStartError(f"another agent is already listening on {self.path} (see `timeslice-verl status`)")
            finally:
                probe.close()

    async def start(self) -> None:
        self.claim_path()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._handle, path=str(self.path), limit=protocol.MAX_REQUEST_BYTES,
                                                           backlog=BACKLOG)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # A closed terminal must not kill the agent mid-handoff (jobs left CUDA-locked): keep serving.
        loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP ignored: the agent keeps serving (stop it with SIGTERM)")
        await self._stop.wait()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._stop.is_set():  # the user insists: leave now; the state file lets the next agent thaw
            frozen = self.arbiter.snapshot().get("jobs", [])
            log.error("%s again: exiting at once, without finishing the shutdown; jobs as recorded: %s. Start the "
                      "agent again with the same state file: it thaws what is left frozen and wakes the tenant",
                      name, [(j.get("name"), j.get("state")) for j in frozen if isinstance(j, dict)])
            logging.shutdown()
            os._exit(128 + sig)
        log.info("%s: shutting down (thawing frozen jobs, waking the tenant); send it again to exit at once", name)
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        """Stop listening, shut the arbiter down (thaw, wake), end the connections, remove the socket."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await self.arbiter.shutdown()
        for writer in list(self._writers):  # end client connections so their handlers finish
            writer.close()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        try:
            await asyncio.wait_for(server.wait_closed(), 5)
        except asyncio.TimeoutError:
            log.warning("connections still open 5 s after closing the socket")
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        log.info("agent stopped")

    # ------------------------------------------------------------------ connections

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, start to end; a peer that vanishes mid-way ends it quietly (never an unhandled
        exception in asyncio's callback)."""
        try:
            await self._connection(reader, writer)
        except (ConnectionError, OSError) as exc:
            log.debug("connection ended: %r", exc)
            writer.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(self._ids)
        peer_pid, peer_uid = peer_credentials(writer.get_extra_info("socket"))
        lock = asyncio.Lock()

        async def send(data: bytes) -> None:
            async with lock:
                writer.write(data)
                await writer.drain()

        if peer_uid is None or peer_uid not in (os.getuid(), 0):
            who = "a peer whose credentials the kernel did not report" if peer_uid is None else f"uid {peer_uid}"
            await send(protocol.error(None, ErrorCode.PERMISSION, f"{who} may not use this agent"))
            writer.close()
            return
        if len(self._writers) >= self.max_connections:  # keep file descriptors for /proc and the driver
            await send(protocol.error(None, ErrorCode.BUSY, f"the agent serves at most {self.max_connections} connections; closing"))
            writer.close()
            return
        self.arbiter.connection_opened(conn, peer_pid)
        tasks: set[asyncio.Task] = set()
        blocking: set[asyncio.Task] = set()
        """Acquires: they wait for the GPU, so a client that stopped sending has no more use for them."""
        me = asyncio.current_task()
        if me is not None:
            self._handlers.add(me)
            me.add_done_callback(self._handlers.discard)
        self._writers.add(writer)
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    await send(protocol.error(None, ErrorCode.TOO_LARGE, f"request longer than {protocol.MAX_REQUEST_BYTES} bytes; closing"))
                    break
                if not line:  # the client stopped sending (maybe only half-closed): answer what it asked
                    await asyncio.gather(*(t for t in tasks if t not in blocking), return_exceptions=True)
                    break
                if not line.strip():
                    continue
                if len(tasks) >= MAX_IN_FLIGHT:  # a client that pipelines without reading: stop reading it
                    await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
                task = asyncio.create_task(self._serve_one(line, conn, peer_uid, send))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if _op(line) == "acquire":
                    blocking.add(task)
                    task.add_done_callback(blocking.discard)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            for task in tasks:
                task.cancel()
            self.arbiter.disconnect(conn)
            try:
                writer.close()
            except Exception:  # pragma: no cover
                pass

    async def _serve_one(self, line: bytes, conn: int, peer_uid: int | None, send) -> None:
        req_id = None
        try:
            req_id, op, args = protocol.parse_request(line.rstrip(b"\n"))
            result = await self._dispatch(op, args, conn, peer_uid)
            if op not in READ_ONLY:  # what the reply says is on disk before the client hears it (a crash
                await asyncio.to_thread(self.arbiter.store.flush)  # right after must not undo a grant)
            reply = protocol.ok(req_id, result)
        except ProtocolError as exc:
            reply = protocol.error(req_id if req_id is not None else protocol.request_id_of(line), exc.code, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("request failed")
            reply = protocol.error(req_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        try:
            await send(reply)
        except (ConnectionError, RuntimeError):
            pass

    async def _dispatch(self, op: str, args: dict[str, Any], conn: int, peer_uid: int | None) -> dict[str, Any]:
        a = self.arbiter
        if op == "hello":
            return self.info()
        if op == "status":
            return {"agent": self.info(), **a.snapshot()}
        if op == "acquire":
            return await a.acquire(args["job"], conn, timeout_s=args.get("timeout_s"), pids=args.get("pids"), peer_uid=peer_uid)
        if op == "release":
            return await a.release(args["job"], conn, wait=args.get("wait", False), done=args.get("done", False),
                                   swap=args.get("swap", "checkpoint"), parked=args.get("parked"))
        if op == "prepare":
            return a.prepare(args["job"], conn, args.get("ttl_s"))
        if op == "register_pids":
            return a.register_pids(args["job"], args["pids"], conn, peer_uid)
        if op == "attach":
            return a.attach(args["job"], conn, holding=args.get("holding", False), peer_uid=peer_uid)
        if op == "register_tenant":
            return await a.register_tenant(args["url"], args.get("sleep_level", 1))
        if op == "unregister_tenant":
            return await a.unregister_tenant()
        raise ProtocolError(ErrorCode.UNKNOWN_OP, op)  # pragma: no cover - parse_request checked it


async def run_agent(settings: TimesliceSettings, *, ready: asyncio.Event | None = None) -> None:
    """Build the backend, the arbiter and the server from ``settings``; serve until SIGTERM/SIGINT.

    Whatever was set up is undone in reverse order however the start or the run ends (the NVML
    probe, the instance lock, the arbiter's shutdown, the listening socket, the metrics endpoint).
    """
    path = socket_path(settings)
    asyncio.get_running_loop().set_exception_handler(_QuietAccept())
    async with contextlib.AsyncExitStack() as stack:
        probe = open_probe(settings.agent.gpus)
        if probe is not None:
            stack.callback(probe.close)
        try:
            backend = make_backend(
                settings.agent.backend,
                probe=probe,
                driver_timeout_s=settings.agent.driver_timeout_s,
                cuda_checkpoint_bin=settings.agent.cuda_checkpoint_bin,
            )
        except BackendUnavailable as exc:
            raise AgentStartError(f"timeslice.agent.backend={settings.agent.backend}: {exc}") from None
        backend.only_on_gpus = not settings.agent.freeze_off_gpu
        if not backend.frees_gpu_memory:
            log.warning("backend %s: %s", backend.name, backend.description)
        if 0 < settings.tenant.reclaim_deadline_s < SHORT_DEADLINE_S:
            log.warning("timeslice.tenant.reclaim_deadline_s=%g leaves the polite yield %.1f s: a behaving vLLM's first "
                        "/sleep pins its host backup (1.5-1.6 s on an H200), so the ladder may abort or kill it; "
                        "%g s or more is safe", settings.tenant.reclaim_deadline_s,
                        budgets(settings.tenant.reclaim_deadline_s).polite_s, SHORT_DEADLINE_S)
        arbiter = Arbiter(
            backend,
            StateStore(state_path(settings).resolve()),  # one file, however the path reaches it (links)
            probe=probe,
            tenant_request_timeout_s=settings.tenant.request_timeout_s,
            tenant_drain_timeout_s=settings.tenant.drain_timeout_s,
            tenant_pause_mode=str(settings.tenant.pause_mode),
            reclaim_deadline_s=settings.tenant.reclaim_deadline_s,
            reattach_grace_s=settings.agent.reattach_grace_s,
            park_overhead_bytes=int(settings.agent.park_overhead_gib * 2**30),
        )
        gpu_ids = probe.uuids() if probe is not None else [str(i) for i in settings.agent.gpus]
        for fd in take_gpu_locks(Path(settings.agent.lock_dir), gpu_ids):
            stack.callback(os.close, fd)
        server = AgentServer(settings, arbiter, path)
        server.max_connections = connection_limit()
        server.claim_path()
        state = state_path(settings).resolve()
        state.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock_fd = take_instance_lock(state.with_name(state.name + ".lock"))  # one agent per state file, too
        stack.callback(os.close, lock_fd)
        # Reconcile recorded state with what the driver reports before serving anyone.
        stack.push_async_callback(arbiter.shutdown)
        await arbiter.start(settings.tenant.url, settings.tenant.sleep_level)
        stack.push_async_callback(server.close)
        await server.start()
        if settings.agent.metrics_port:
            from timeslice_verl.agent.metrics import start_exporter

            stack.callback(start_exporter(arbiter, settings.agent.metrics_host, settings.agent.metrics_port).close)
        log.info(
            "agent %s listening on %s (backend %s, GPUs %s, tenant %s, state %s)",
            __version__, path, backend.name, settings.agent.gpus, settings.tenant.url or "none", state_path(settings),
        )
        if ready is not None:
            ready.set()
        await server.serve_forever()
