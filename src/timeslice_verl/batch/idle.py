"""When a feeder with nothing to send looks for lines again: at once when told — the service's kick (a batch created
on this node), the database's notification (PostgreSQL: a batch created, lines put back, on any node:
:mod:`~timeslice_verl.batch.pgnotify`) — else at the next look, every :data:`POLL_S`, or every
:data:`NOTIFIED_POLL_S` where the database tells (the look then only catches what no notification says: a retry's
wait run out)."""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from timeslice_verl.batch.engine import Closable

POLL_S = 0.2
NOTIFIED_POLL_S = 2.0


class Listening(Protocol):
    def listen(self, wake: Callable[[], None]) -> Closable | None: ...


class Waker:
    """The feeder's ears: ``woken`` counts the notifications that woke it (``room``: the event its loop waits on)."""

    def __init__(self, room: asyncio.Event) -> None:
        self.room = room
        self.woken = 0
        self._listener: Closable | None = None

    def start(self, store: Listening) -> None:
        """Listen, where ``store``'s engine can tell (from within the feeder's event loop)."""
        loop = asyncio.get_running_loop()
        self._listener = store.listen(lambda: loop.call_soon_threadsafe(self._woken))

    def _woken(self) -> None:
        self.woken += 1
        self.room.set()

    @property
    def poll_s(self) -> float:
        """How long an idle feeder waits before it looks for lines untold."""
        return NOTIFIED_POLL_S if self._listener is not None else POLL_S

    async def close(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await asyncio.to_thread(listener.close)


__all__ = ["NOTIFIED_POLL_S", "POLL_S", "Waker"]
