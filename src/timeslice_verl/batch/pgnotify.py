"""Feeders woken by the database on PostgreSQL: a transaction that makes lines claimable (a batch created, lines put
back from a holder that is gone or from a gate that closed) sends ``NOTIFY`` at its commit, and each feeder listens
on a connection of its own, so a feeder of another node claims a new batch's lines at once instead of at its next
look. The look stays, at a longer interval, for what no notification says (a retry's wait run out, a notification
sent while the listener reconnected: it wakes its feeder once connected again).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from timeslice_verl.batch.engine import POSTGRESQL
from timeslice_verl.batch.redact import redact
from timeslice_verl.log import get_logger

log = get_logger("batch")

LISTEN_TIMEOUT_S = 1.0
"""How long the listener waits for a notification before it looks whether it was closed."""
RECONNECT_S = 2.0


class Listener:
    """A thread with its own connection that listens for claimable lines and calls ``wake`` (from that thread) for
    each notification, and once each time it has (re)connected."""

    def __init__(self, connect: Callable[[], Any], wake: Callable[[], None], where: str) -> None:
        self.connect, self.wake, self.where = connect, wake, where
        self.listening = threading.Event()
        """Set while a connection listens (a notification sent now reaches ``wake``)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeslice-batch-listen", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with self.connect() as conn:
                    conn.execute(POSTGRESQL.sql("listen_lines"))
                    self.listening.set()
                    self.wake()  # what was sent while no connection listened
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=LISTEN_TIMEOUT_S):
                            self.wake()
            except psycopg.Error as exc:
                text = redact(str(exc).strip())
                log.warning("batch: %s: not listening for new lines (%s); looking for them at intervals meanwhile",
                            self.where, text.splitlines()[0] if text else type(exc).__name__)
            finally:
                self.listening.clear()
            self._stop.wait(RECONNECT_S)

    def close(self) -> None:
        """Stop listening; its connection is closed within :data:`LISTEN_TIMEOUT_S`."""
        self._stop.set()
        self._thread.join(timeout=LISTEN_TIMEOUT_S * 5)


__all__ = ["Listener"]
