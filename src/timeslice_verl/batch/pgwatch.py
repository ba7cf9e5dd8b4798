"""A bound on every wait for the PostgreSQL server's answer, the client's own.

``statement_timeout`` is the server's: a server that is stopped (SIGSTOP, a frozen VM) or cut off without a reset
never sends it, its kernel may even acknowledge what is sent (TCP keepalives then succeed), and psycopg waits for
the answer without end. :class:`Watchdog` watches each connection while a call uses it; a statement not answered
within its bound gets its connection shut down, so the waiting call fails at once (psycopg: the server closed the
connection), the pool drops that connection, and the caller hears :class:`~timeslice_verl.batch.engine.StoreUnavailable`
— the feeder tries again later, the API answers 503.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, Iterator

from timeslice_verl.log import get_logger

log = get_logger("batch")


class Watch:
    """One call's use of a connection: :meth:`beat` before each statement starts its bound anew."""

    def __init__(self, dog: Watchdog, conn: Any, bound_s: float) -> None:
        self.dog, self.conn, self.bound_s = dog, conn, bound_s
        self.due = time.monotonic() + bound_s
        self.cut = False
        """The watchdog cut this connection: the server did not answer within ``bound_s``."""

    def beat(self) -> None:
        self.due = time.monotonic() + self.bound_s


class Watchdog:
    """Cuts the connection of a watched call whose server has not answered within the call's bound."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._watched: dict[int, Watch] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = 0.1

    @contextlib.contextmanager
    def watch(self, conn: Any, bound_s: float) -> Iterator[Watch]:
        w = Watch(self, conn, bound_s)
        with self._lock:
            self._tick = min(self._tick, max(0.02, bound_s / 20))
            self._watched[id(w)] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"{self.name}-watchdog", daemon=True)
                self._thread.start()
        try:
            yield w
        finally:
            with self._lock:
                self._watched.pop(id(w), None)

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        while not self._closed.wait(self._tick):
            now = time.monotonic()
            with self._lock:
                late = [w for w in self._watched.values() if not w.cut and now > w.due]
                for w in late:
                    w.cut = True
            for w in late:
                log.warning("batch: %s did not answer within %.1f s: its connection is cut", self.name, w.bound_s)
                cut(w.conn)


def cut(conn: Any) -> None:
    """Shut the connection's socket down (both ways): a wait on it ends at once, on any thread."""
    try:
        fd = conn.pgconn.socket
    except Exception:  # noqa: BLE001 - closed already: nothing waits on it
        return
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


__all__ = ["Watch", "Watchdog", "cut"]
