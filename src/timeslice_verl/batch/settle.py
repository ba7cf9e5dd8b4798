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
            db.execute("SELECT id FROM batches WHERE id = ?" + dialect.lock, (bid,))


def settle(db: Tx, bid: str, now: int, *, created: bool = False) -> None:
    """End the batch when nothing of it waits or runs: completed; or cancelled, or expired past its window, with
    the lines never sent failed as such (each ``custom_id`` still appears once in the error file; as in OpenAI's
    counts, they are neither completed nor failed). O(1) but for those lines. A batch cancelled while it is
    created (no ``in_progress_at``) ends when its creation does (``created``), with its whole total. The caller
    holds the batch's row."""
    row = db.execute("SELECT status, expires_at, expired_at, in_progress_at, queued, inflight FROM batches WHERE id = ?",
                     (bid,)).fetchone()
    if row is None or row["status"] in ENDED or (row["in_progress_at"] is None and not created):
        return
    status, expired, queued = row["status"], row["expired_at"] is not None, row["queued"]
    if status == "in_progress" and now >= row["expires_at"]:
        db.execute("UPDATE batches SET status = 'cancelling', expired_at = ? WHERE id = ?", (now, bid))
        status, expired = "cancelling", True
    what = "expired" if expired else "cancelled"
    if status == "cancelling" and queued:
        err = json.dumps({"code": f"batch_{what}", "message": f"the batch was {what} before this request was sent"})
        moved = db.execute("UPDATE lines SET state = 'failed', error = ? WHERE batch_id = ? AND state = 'queued'",
                           (err, bid)).rowcount
        db.execute("UPDATE batches SET queued = queued - ? WHERE id = ?", (moved, bid))
        queued -= moved
    if queued or row["inflight"]:
        return
    if status == "cancelling":
        db.execute(f"UPDATE batches SET status = ?, {what}_at = ? WHERE id = ?", (what, now, bid))
    else:
        db.execute("UPDATE batches SET status = 'completed', finalizing_at = ?, completed_at = ? WHERE id = ?",
                   (now, now, bid))


__all__ = ["lock_batches", "settle"]
