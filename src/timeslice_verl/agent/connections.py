"""The agent's connection loop: one client a connection (a trainer's agent plugin, the CLI), several requests in
flight on it, and what it holds released when it closes.

Each connection's peer credentials (``SO_PEERCRED``) are checked against the agent's user; the number of
connections and of requests in flight on one are bounded (file descriptors are kept for ``/proc``, the state file
and the driver). A reply to a request that changes state is sent once that state is on disk.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from typing import Any, Awaitable, Callable

from timeslice_verl.agent.client import protocol
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.dispatch import READ_ONLY, Dispatcher
from timeslice_verl.agent.host import MAX_CONNECTIONS
from timeslice_verl.agent.client.protocol import ErrorCode, ProtocolError, peer_credentials
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


class Connections:
    def __init__(self, arbiter: Arbiter, dispatch: Dispatcher) -> None:
        self.arbiter, self.dispatch = arbiter, dispatch
        self.max_connections = MAX_CONNECTIONS
        self._ids = itertools.count(1)
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, start to end; a peer that vanishes mid-way ends it quietly (never an unhandled exception
        in asyncio's callback)."""
        try:
            await self._connection(reader, writer)
        except (ConnectionError, OSError) as exc:
            log.debug("connection ended: %r", exc)
            writer.close()

    async def close_all(self, timeout_s: float) -> None:
        """End every client connection and wait (up to ``timeout_s``) for their handlers."""
        for writer in list(self._writers):
            writer.close()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=timeout_s)

    def _sender(self, writer: asyncio.StreamWriter) -> Callable[[bytes], Awaitable[None]]:
        lock = asyncio.Lock()

        async def send(data: bytes) -> None:
            async with lock:
                writer.write(data)
                await writer.drain()

        return send

    async def _admit(self, writer: asyncio.StreamWriter, send: Callable[[bytes], Awaitable[None]]) -> tuple[int | None, int | None] | None:
        peer_pid, peer_uid = peer_credentials(writer.get_extra_info("socket"))
        if peer_uid is None or peer_uid not in (os.getuid(), 0):
            who = "a peer whose credentials the kernel did not report" if peer_uid is None else f"uid {peer_uid}"
            await send(protocol.error(None, ErrorCode.PERMISSION, f"{who} may not use this agent"))
            writer.close()
            return None
        if len(self._writers) >= self.max_connections:  # keep file descriptors for /proc and the driver
            await send(protocol.error(None, ErrorCode.BUSY, f"the agent serves at most {self.max_connections} connections; closing"))
            writer.close()
            return None
        return peer_pid, peer_uid

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(self._ids)
        send = self._sender(writer)
        admitted = await self._admit(writer, send)
        if admitted is None:
            return
        peer_pid, peer_uid = admitted
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
            await self._read(reader, send, conn, peer_uid, tasks, blocking)
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

    async def _read(self, reader: asyncio.StreamReader, send: Callable[[bytes], Awaitable[None]], conn: int,
                    peer_uid: int | None, tasks: set[asyncio.Task], blocking: set[asyncio.Task]) -> None:
        while True:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                await send(protocol.error(None, ErrorCode.TOO_LARGE, f"request longer than {protocol.MAX_REQUEST_BYTES} bytes; closing"))
                return
            if not line:  # the client stopped sending (maybe only half-closed): answer what it asked
                await asyncio.gather(*(t for t in tasks if t not in blocking), return_exceptions=True)
                return
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

    async def _serve_one(self, line: bytes, conn: int, peer_uid: int | None, send: Callable[[bytes], Awaitable[None]]) -> None:
        req_id = None
        try:
            req_id, op, args = protocol.parse_request(line.rstrip(b"\n"))
            result = await self.dispatch(op, args, conn, peer_uid)
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


__all__ = ["MAX_IN_FLIGHT", "Connections"]
