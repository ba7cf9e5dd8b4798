"""Where the agent listens: a Unix socket in a directory only its user can enter (as aiohttp's ``UnixSite``).

:func:`private_directory` is the one check of a directory the agent keeps its socket or its state in: it must be
the agent's user's and writable by nobody else, so nobody can plant a socket, a state file or a link there.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path
from typing import Any, Awaitable, Callable

from timeslice_verl import private
from timeslice_verl.agent.client import protocol
from timeslice_verl.agent.host import BACKLOG, AgentStartError
from timeslice_verl.log import get_logger

log = get_logger("agent")


def private_directory(path: Path, key: str) -> None:
    """Create ``path`` (0700) or check that it is the agent's user's and not writable by others; raise
    :class:`AgentStartError` naming ``key`` otherwise."""
    try:
        private.private_directory(path, key)
    except private.NotPrivate as exc:
        raise AgentStartError(str(exc)) from None


def private_file(path: Path, key: str) -> None:
    """An existing file the agent reads back (its state): the agent's user's and writable by nobody else."""
    try:
        private.private_file(path, key)
    except private.NotPrivate as exc:
        raise AgentStartError(str(exc)) from None


class UnixSite:
    """The agent's socket: claimed (a stale one of a dead agent removed, a live one refused), served, removed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server: asyncio.AbstractServer | None = None

    def claim(self) -> None:
        """Fail early if another agent serves this socket; remove a stale one (never what is not a socket)."""
        private_directory(self.path.parent, "timeslice.agent.socket")
        if not (self.path.exists() or self.path.is_symlink()):
            return
        if not stat.S_ISSOCK(self.path.lstat().st_mode):  # never delete what is not a socket (we did not create it)
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

    async def start(self, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[Any]]) -> None:
        self.claim()
        old = os.umask(0o177)
        try:
            self.server = await asyncio.start_unix_server(handle, path=str(self.path), limit=protocol.MAX_REQUEST_BYTES,
                                                          backlog=BACKLOG)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    def stop_listening(self) -> asyncio.AbstractServer | None:
        server, self.server = self.server, None
        if server is not None:
            server.close()
        return server

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


__all__ = ["UnixSite", "private_directory", "private_file"]
