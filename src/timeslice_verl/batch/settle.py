"""A batch's end and the order rows are locked in: what the store (batches) and the line queue (lines in motion) both
need, kept below both so the queue is a part the store holds rather than a class it is made of."""

from __future__ import annotations

import json
from typing import Iterable

from timeslice_verl.batch.engine import Dialect, Tx
from timeslice_verl.batch.status import ENDED


def lock_batches(db: Tx, dialect: Dialect, ids: Iterable[str]) -> None:
    """Hold these batches' rows until the commit, in id order (PostgreSQL; SQLite holds the whole file): every
    transaction that touches lines locks their batches first, so feeders on several nodes never deadlock."""
    if dialect.lock:
        for bid in sorted(set(ids)):
            db.execute(dialect.sql("lock_batch"), (bid,))


def wake(db: Tx, dialect: Dialect) -> None:
    """Lines became claimable: the feeders of every node are told at the commit (PostgreSQL's ``NOTIFY``; one node's
    service kicks its own feeders)."""
    if dialect.shared:
        db.execute(dialect.sql("notify_lines"))


def settle(db: Tx, dialect: Dialect, bid: str, *, created: bool = False) -> None:
    """End the batch when nothing of it waits or runs: completed; or cancelled, or expired past its window, with
    the lines never sent failed as such (each ``custom_id`` still appears once in the error file; as in OpenAI's
    counts, they are neither completed nor failed). O(1) but for those lines. A batch cancelled while it is
    created (no ``in_progress_at``) ends when its creation does (``created``), with its whole total. The caller
    holds the batch's row. The window is read on the database's clock (the batch may have been created on another
    node)."""
    row = db.execute(dialect.sql("settle_read"), (bid,)).fetchone()
    if row is None or row["status"] in ENDED or (row["in_progress_at"] is None and not created):
        return
    status, expired, queued, now = row["status"], row["expired_at"] is not None, row["queued"], int(row["now"])
    if status == "in_progress" and now >= row["expires_at"]:
        db.execute(dialect.sql("batch_expire"), (now, bid))
        status, expired = "cancelling", True
    what = "expired" if expired else "cancelled"
    if status == "cancelling" and queued:
        err = json.dumps({"code": f"batch_{what}", "message": f"the batch was {what} before this request was sent"})
        moved = db.execute(dialect.sql("lines_fail_queued"), (err, bid)).rowcount
        db.execute(dialect.sql("batch_unqueued"), (moved, bid))
        queued -= moved
    if queued or row["inflight"]:
        return
    if status == "cancelling":
        db.execute(dialect.sql("batch_expired" if expired else "batch_cancelled"), (now, bid))
    else:
        db.execute(dialect.sql("batch_completed"), (now, now, bid))


__all__ = ["lock_batches", "settle", "wake"]
