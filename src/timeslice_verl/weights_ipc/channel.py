"""The control channel between a sender and its receivers: a Unix socket in a fresh 0700 directory.

Only bucket descriptions, CUDA IPC handles and acknowledgements travel here (the weights stay on the GPU). Messages
are length-prefixed pickles; a peer must run as this user (``SO_PEERCRED``), and the directory lets no one else in.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timeslice_verl.weights import WeightsError

_HEADER = struct.Struct("!Q")
_MAX_MESSAGE = 1 << 30
_SUN_PATH_MAX = 107


class ChannelError(WeightsError):
    """The peer went away, answered late or out of turn, or is not this user; the message says which."""


@dataclass(frozen=True)
class Address:
    """Where a sender listens (a filesystem socket path)."""

    path: str


def _socket_dir() -> Path:
    base = Path(tempfile.gettempdir())
    if len(str(base)) > 60:  # a long TMPDIR would push the socket path past sun_path's limit
        base = Path("/tmp")
    return Path(tempfile.mkdtemp(prefix="timeslice-ipc-", dir=base))  # mkdtemp: mode 0700, this user's


class Listener:
    """A listening socket in its own private directory, removed by :meth:`close`."""

    def __init__(self) -> None:
        self.dir = _socket_dir()
        path = self.dir / "ctl.sock"
        if len(str(path)) > _SUN_PATH_MAX:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise ChannelError(f"socket path {path} is longer than a Unix socket allows; set TMPDIR shorter")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(str(path))
            self.sock.listen(64)
        except OSError:
            self.close()
            raise
        self.address = Address(str(path))

    def accept(self, timeout_s: float) -> socket.socket:
        self.sock.settimeout(timeout_s)
        try:
            conn, _ = self.sock.accept()
        except socket.timeout:
            raise ChannelError(f"no receiver connected to {self.address.path} within {timeout_s:.0f} s") from None
        conn.settimeout(None)
        uid = _peer_uid(conn)
        if uid != os.getuid():
            conn.close()
            raise ChannelError(f"a process of uid {uid} connected to {self.address.path}; only uid {os.getuid()} may")
        return conn

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def connect(address: Address, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address.path)
    except OSError as exc:
        sock.close()
        raise ChannelError(f"cannot reach the sender at {address.path}: {exc.strerror or exc}") from None
    sock.settimeout(None)
    return sock


def send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        sock.sendall(_HEADER.pack(len(data)) + data)
    except OSError as exc:
        raise ChannelError(f"the peer went away while sending {type(message).__name__}: {exc}") from None


def _read(sock: socket.socket, size: int, what: str) -> bytes:
    chunks, left = [], size
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except socket.timeout:
            raise ChannelError(f"no {what} from the peer in time") from None
        except OSError as exc:
            raise ChannelError(f"the peer went away before its {what}: {exc}") from None
        if not chunk:
            raise ChannelError(f"the peer closed the channel before its {what}")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket, timeout_s: float, what: str, *expected: type) -> Any:
    """The next message, which must be one of ``expected`` (a peer's refusal arrives as a :class:`Refusal`)."""
    sock.settimeout(timeout_s)
    try:
        (size,) = _HEADER.unpack(_read(sock, _HEADER.size, what))
        if size > _MAX_MESSAGE:
            raise ChannelError(f"the peer announced a {size}-byte {what}: not a message of this channel")
        message = pickle.loads(_read(sock, size, what))
    finally:
        sock.settimeout(None)
    if isinstance(message, Refusal):
        raise ChannelError(f"the peer refused: {message.reason}")
    if expected and not isinstance(message, expected):
        raise ChannelError(f"expected {what}, got {type(message).__name__}")
    return message


@dataclass(frozen=True)
class Refusal:
    """Either side → the other: the transfer cannot go on, and why (raised there as :class:`ChannelError`)."""

    reason: str


__all__ = ["Address", "ChannelError", "Listener", "Refusal", "connect", "receive", "send"]
