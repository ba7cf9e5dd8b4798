"""What the agent takes from its host: a lock per GPU and per state file (one agent each), and file
descriptors (the soft limit raised, connections bounded below it, accept errors logged sparingly)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import resource
import time
from pathlib import Path
from typing import Any

from timeslice_verl.log import get_logger

log = get_logger("agent")

MAX_CONNECTIONS = 256
"""Open client connections at a time (each holds a file descriptor)."""
BACKLOG = 16
"""Connections the kernel queues, and asyncio accepts in one go, before the agent can refuse any."""


class AgentStartError(RuntimeError):
    """The agent cannot start (socket in use, backend unavailable…). The message says what to do."""


FD_RESERVE = 64
"""File descriptors kept free of client connections: /proc reads, the state file, the driver, the tenant."""


def connection_limit() -> int:
    """Client connections at a time: MAX_CONNECTIONS, fewer when this process may open few files. The soft
    limit is first raised to the hard one (a daemon's due): a full table would fail /proc reads and state
    writes, and asyncio would log every refused accept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 20), hard))
            soft = min(hard, 1 << 20)
        except (ValueError, OSError):
            pass
    return max(1, min(MAX_CONNECTIONS, soft - FD_RESERVE - BACKLOG))


class _QuietAccept:
    """The event loop's exception handler, with asyncio's "out of system resource" accept errors logged
    at most every 10 s (it retries each second: unlimited, they flooded the log at hundreds of KB/s)."""

    def __init__(self) -> None:
        self.last, self.dropped = 0.0, 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last < 10:
            self.dropped += 1
            return
        log.error("cannot accept connections: %s (%s); %d more like it in the last 10 s not logged",
                  context.get("exception"), context.get("message"), self.dropped)
        self.last, self.dropped = now, 0


def take_gpu_locks(lock_dir: Path, gpus: list[str]) -> list[int]:
    """An exclusive ``flock`` per GPU, held for the agent's lifetime: two agents never arbitrate one GPU
    (each would lend it to its tenant). A lock file another user made is read-only to us: still lockable."""
    fds: list[int] = []
    try:
        for gpu in gpus:
            path = lock_dir / f"timeslice-verl-gpu-{gpu}.lock"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise AgentStartError(f"timeslice.agent.lock_dir: cannot open {path} ({exc}); is another agent's "
                                      "lock there, or a link?") from None
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise AgentStartError(f"another agent already arbitrates GPU {gpu} (it holds {path}): one agent per "
                                      "GPU; stop it or give this one other timeslice.agent.gpus") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def take_instance_lock(path: Path) -> int:
    """An exclusive ``flock`` on ``path`` held for the agent's lifetime: one agent per socket and state file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AgentStartError(f"another agent holds {path} (see `timeslice-verl status`)") from None
    return fd
