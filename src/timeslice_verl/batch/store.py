"""The batch service's state: one SQLite file (WAL), a schema version, every line's fate in one row, and each
batch's counters beside it — so every call costs the same at line 1 and line 50 000.

A line is ``queued`` (waiting, maybe until ``next_at`` after a failed try), ``inflight`` (sent to the tenant), ``done``
(its response recorded) or ``failed`` (its error recorded). A line's response or error is written in the same
transaction that ends it and moves its batch's counters, so the output and error files — made from these rows when
downloaded — hold every ``custom_id`` of a batch exactly once, also after a ``kill -9``: lines found ``inflight`` at
start go back to the queue (a request whose answer was lost, or answered but not yet written, is asked again;
only an answer that was recorded counts, and a second answer for a line that is no longer in flight is dropped).

Costs per line are constant: a claim reads the oldest open batch's next lines through the ``(batch_id, state, idx)``
index, results are written many to a transaction (:meth:`Store.record`), and whether a batch has ended is read
off its counters, never counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from timeslice_verl.batch.lines import RequestLine
from timeslice_verl.batch.schema import SCHEMA_VERSION, migrate
from timeslice_verl.batch.status import ENDED, OPEN
from timeslice_verl.private import NotPrivate, create_private, private_file

COUNTERS = ("queued", "inflight", "done", "failed")
INSERT_CHUNK = 2048
"""Lines a transaction of a batch's creation inserts (the feeder's writes go between two)."""


class StoreError(RuntimeError):
    """The state file is not one this version reads (another schema, corrupt), or cannot be opened."""


@dataclass(frozen=True)
class Line:
    batch_id: str
    idx: int
    custom_id: str
    body: str
    """The request's body as JSON text (sent as it was uploaded)."""
    attempts: int
    endpoint: str


@dataclass(frozen=True)
class Outcome:
    """What became of one try of a line: ``done`` (its response), ``queued`` (again, from ``next_at``) or ``failed``."""

    line: Line
    state: Literal["done", "queued", "failed"]
    response: str | None = None
    """JSON text: ``{"status_code", "request_id", "body"}``."""
    error: str | None = None
    tokens: int = 0
    next_at: float = 0.0


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _private_db(path: Path) -> None:
    """The database holds every prompt and answer: in a directory only its user writes, readable by nobody else."""
    try:
        create_private(path, "timeslice.batch.db")  # an empty file is an empty SQLite database
        private_file(path, "timeslice.batch.db")
        os.chmod(path, 0o600)  # one of ours made before the service was private
    except NotPrivate as exc:
        raise StoreError(str(exc)) from None


class Store:
    """The service's one SQLite connection, serialised by a lock (requests come from FastAPI's threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        _private_db(path)
        self._lock = threading.RLock()
        try:
            self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
            self.db.row_factory = sqlite3.Row
            with self._lock:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: a committed line survives a kill of the service
                migrate(self.db, str(path))
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"timeslice.batch.db: {path} cannot be used: {exc}") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                if self.db.in_transaction:  # SQLite itself rolls back on some errors (a full disk): keep the cause
                    self.db.execute("ROLLBACK")
                raise
            try:
                self.db.execute("COMMIT")
            except sqlite3.Error:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise

    def query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self.db.close()

    # ------------------------------------------------------------------ files

    def file(self, fid: str) -> dict[str, Any] | None:
        rows = self.query("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?", (fid,))
        return dict(rows[0]) if rows else None

    def files(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.query("SELECT id, purpose, filename, bytes, created_at FROM files ORDER BY created_at")]

    # ------------------------------------------------------------------ batches

    def create_batch(self, endpoint: str, input_file_id: str, window_s: int, window: str, metadata: Any,
                     lines: Iterable[RequestLine]) -> str:
        """A batch of ``lines`` (:class:`~timeslice_verl.batch.lines.RequestLine`); a line with an error is failed from
        the start. ``lines`` may be a generator: it is inserted as it comes, a chunk a transaction, the batch
        ``validating`` (never claimed) until the last; an exception from it (a file refused as a whole) deletes
        what was inserted and is raised."""
        bid, now = new_id("batch"), int(time.time())
        with self.transaction() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, created_at, "
                       "expires_at, total) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, 0)",
                       (bid, endpoint, input_file_id, window, json.dumps(metadata) if metadata else None, now, now + window_s))
        counts = {"queued": 0, "failed": 0}
        try:
            chunk: list[tuple] = []
            for i, line in enumerate(lines):
                state = "failed" if line.error else "queued"
                counts[state] += 1
                chunk.append((bid, i, line.custom_id, line.body, state, json.dumps(line.error.to_dict()) if line.error else None))
                if len(chunk) >= INSERT_CHUNK:
                    self._insert(chunk)
            self._insert(chunk)
        except BaseException:
            with self.transaction() as db:
                db.execute("DELETE FROM lines WHERE batch_id = ?", (bid,))
                db.execute("DELETE FROM batches WHERE id = ?", (bid,))
            raise
        with self.transaction() as db:  # cancelled meanwhile: its lines fail as never sent, and it ends cancelled
            db.execute("UPDATE batches SET total = ?, queued = ?, failed = ?, in_progress_at = ?, status = CASE status WHEN "
                       "'validating' THEN 'in_progress' ELSE 'cancelling' END WHERE id = ?",
                       (counts["queued"] + counts["failed"], counts["queued"], counts["failed"], int(time.time()), bid))
            self._settle(db, bid, int(time.time()))
        return bid

    def _insert(self, chunk: list[tuple]) -> None:
        with self.transaction() as db:
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, body, state, error) VALUES (?, ?, ?, ?, ?, ?)", chunk)
        chunk.clear()

    def batch(self, bid: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM batches WHERE id = ?", (bid,))
        return dict(rows[0]) if rows else None

    def batches(self, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        """Newest first (creation order, ties by insertion); ``after``: the ones older than that batch."""
        sql, args = "SELECT * FROM batches", ()
        if after:
            sql, args = sql + " WHERE rowid < (SELECT rowid FROM batches WHERE id = ?)", (after,)
        return [dict(r) for r in self.query(sql + " ORDER BY rowid DESC LIMIT ?", (*args, limit))]

    def counts(self, bid: str) -> dict[str, int]:
        rows = self.query("SELECT queued, inflight, done, failed FROM batches WHERE id = ?", (bid,))
        r = rows[0] if rows else {"queued": 0, "inflight": 0, "done": 0, "failed": 0}
        return {"queued": r["queued"], "inflight": r["inflight"], "completed": r["done"], "failed": r["failed"]}

    def cancel(self, bid: str) -> bool:
        now = int(time.time())
        with self.transaction() as db:
            moved = db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND status IN "
                               "('validating', 'in_progress')", (now, bid)).rowcount
            self._settle(db, bid, now)
        return moved > 0

    def settle_open(self) -> None:
        """End what can end without a line moving: batches past their window, cancels with nothing in flight."""
        now = int(time.time())
        with self.transaction() as db:
            for row in db.execute("SELECT id FROM batches WHERE status IN ('in_progress', 'cancelling')").fetchall():
                self._settle(db, row["id"], now)

    @staticmethod
    def _settle(db: sqlite3.Connection, bid: str, now: int) -> None:
        """End the batch when nothing of it waits or runs: completed; or cancelled, or expired past its window, with
        the lines never sent failed as such (each ``custom_id`` still appears once). O(1) but for those lines."""
        row = db.execute("SELECT status, expires_at, expired_at, queued, inflight FROM batches WHERE id = ?",
                         (bid,)).fetchone()
        if row is None or row["status"] in ENDED:
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
            db.execute("UPDATE batches SET queued = queued - ?, failed = failed + ? WHERE id = ?", (moved, moved, bid))
            queued -= moved
        if queued or row["inflight"]:
            return
        if status == "cancelling":
            db.execute(f"UPDATE batches SET status = ?, {what}_at = ? WHERE id = ?", (what, now, bid))
        else:
            db.execute("UPDATE batches SET status = 'completed', finalizing_at = ?, completed_at = ? WHERE id = ?",
                       (now, now, bid))

    # ------------------------------------------------------------------ lines

    def recover(self) -> int:
        """At start: lines a killed service left in flight go back to the queue; a batch whose creation it did not
        finish is failed, saying so (its lines were never sent)."""
        n, now = 0, int(time.time())
        err = json.dumps({"object": "list", "data": [{"code": "interrupted", "line": None, "param": "input_file_id",
                          "message": "the batch service stopped while it created this batch: create it again"}]})
        with self.transaction() as db:
            for row in db.execute("SELECT id FROM batches WHERE status = 'validating'").fetchall():
                db.execute("DELETE FROM lines WHERE batch_id = ?", (row["id"],))
                db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ?, total = 0, queued = 0, "
                           "failed = 0 WHERE id = ?", (now, err, row["id"]))
            for row in db.execute("SELECT id FROM batches WHERE inflight > 0").fetchall():
                moved = db.execute("UPDATE lines SET state = 'queued', next_at = 0 WHERE batch_id = ? AND state = 'inflight'",
                                   (row["id"],)).rowcount
                db.execute("UPDATE batches SET inflight = inflight - ?, queued = queued + ? WHERE id = ?",
                           (moved, moved, row["id"]))
                n += moved
        return n

    def claim(self, n: int, now: float) -> list[Line]:
        """Up to ``n`` lines ready to send, oldest batch first and in input order within it, marked in flight (one
        more try each)."""
        out: list[Line] = []
        if n <= 0:
            return out
        with self.transaction() as db:
            for b in db.execute("SELECT id, endpoint FROM batches WHERE status = 'in_progress' AND queued > 0 "
                                "ORDER BY rowid").fetchall():
                rows = db.execute("SELECT idx, custom_id, body, attempts FROM lines WHERE batch_id = ? AND state = 'queued' "
                                  "AND next_at <= ? ORDER BY idx LIMIT ?", (b["id"], now, n - len(out))).fetchall()
                if not rows:
                    continue
                db.executemany("UPDATE lines SET state = 'inflight', attempts = attempts + 1 WHERE batch_id = ? AND idx = ?",
                               [(b["id"], r["idx"]) for r in rows])
                again = sum(1 for r in rows if r["attempts"])
                db.execute("UPDATE batches SET queued = queued - ?, inflight = inflight + ?, retried = retried + ? "
                           "WHERE id = ?", (len(rows), len(rows), again, b["id"]))
                out += [Line(b["id"], r["idx"], r["custom_id"], r["body"], r["attempts"] + 1, b["endpoint"]) for r in rows]
                if len(out) >= n:
                    break
        return out

    def release(self, lines: list[Line]) -> int:
        """Lines claimed and never sent go back to the queue, their try not counted."""
        moved: dict[str, int] = {}
        with self.transaction() as db:
            for ln in lines:
                if db.execute("UPDATE lines SET state = 'queued', attempts = attempts - 1 WHERE batch_id = ? AND idx = ? "
                              "AND state = 'inflight'", (ln.batch_id, ln.idx)).rowcount:
                    moved[ln.batch_id] = moved.get(ln.batch_id, 0) + 1
            for bid, n in moved.items():
                again = sum(1 for ln in lines if ln.batch_id == bid and ln.attempts > 1)
                db.execute("UPDATE batches SET inflight = inflight - ?, queued = queued + ?, retried = retried - ? "
                           "WHERE id = ?", (n, n, again, bid))
                self._settle(db, bid, int(time.time()))
        return sum(moved.values())

    def record(self, outcomes: list[Outcome]) -> int:
        """Write many lines' outcomes in one transaction; how many took effect (a line no longer in flight — answered
        already, or its batch cancelled meanwhile — is left as it is)."""
        moved: dict[str, dict[str, int]] = {}
        now = time.time()
        with self.transaction() as db:
            for o in outcomes:
                ln = o.line
                if o.state == "done":
                    cur = db.execute("UPDATE lines SET state = 'done', response = ?, tokens = ?, done_at = ? WHERE batch_id = ? "
                                     "AND idx = ? AND state = 'inflight'", (o.response, o.tokens, now, ln.batch_id, ln.idx))
                elif o.state == "queued":
                    cur = db.execute("UPDATE lines SET state = 'queued', next_at = ? WHERE batch_id = ? AND idx = ? AND "
                                     "state = 'inflight'", (o.next_at, ln.batch_id, ln.idx))
                else:
                    cur = db.execute("UPDATE lines SET state = 'failed', error = ?, response = ? WHERE batch_id = ? AND "
                                     "idx = ? AND state = 'inflight'", (o.error, o.response, ln.batch_id, ln.idx))
                if cur.rowcount:
                    c = moved.setdefault(ln.batch_id, {"queued": 0, "done": 0, "failed": 0, "n": 0, "tokens": 0})
                    c[o.state] += 1
                    c["n"] += 1
                    c["tokens"] += o.tokens if o.state == "done" else 0
            for bid, c in moved.items():
                db.execute("UPDATE batches SET inflight = inflight - ?, queued = queued + ?, done = done + ?, "
                           "failed = failed + ?, tokens = tokens + ? WHERE id = ?",
                           (c["n"], c["queued"], c["done"], c["failed"], c["tokens"], bid))
                self._settle(db, bid, int(now))
        return sum(c["n"] for c in moved.values())

    def done(self, line: Line, response: dict[str, Any], tokens: int) -> None:
        self.record([Outcome(line, "done", response=json.dumps(response), tokens=tokens)])

    def again(self, line: Line, delay_s: float) -> None:
        self.record([Outcome(line, "queued", next_at=time.time() + delay_s)])

    def failed(self, line: Line, error: dict[str, Any], response: dict[str, Any] | None = None) -> None:
        self.record([Outcome(line, "failed", error=json.dumps(error), response=json.dumps(response) if response else None)])

    def results(self, bid: str, state: str) -> Iterator[sqlite3.Row]:
        """The ended lines of a batch in input order (``done``: the output file, ``failed``: the error file)."""
        return iter(self.query("SELECT idx, custom_id, response, error FROM lines WHERE batch_id = ? AND state = ? "
                               "ORDER BY idx", (bid, state)))

    def figures(self, bid: str) -> dict[str, Any]:
        """One batch's lines by fate: completed, failed by error code, the tries beyond each line's first, tokens."""
        row = self.batch(bid) or {}
        out: dict[str, Any] = {"completed": row.get("done", 0), "failed": {}, "retried": row.get("retried", 0),
                               "tokens": row.get("tokens", 0), "open": row.get("queued", 0) + row.get("inflight", 0)}
        for r in self.query("SELECT json_extract(error, '$.code') AS code, COUNT(*) AS n FROM lines WHERE batch_id = ? "
                            "AND state = 'failed' GROUP BY code", (bid,)):
            out["failed"][r["code"] or "unknown"] = r["n"]
        return out

    def totals(self) -> dict[str, int]:
        """Lines by state, over every batch; ``retried``: the tries beyond each line's first; ``tokens`` generated."""
        r = self.query("SELECT TOTAL(queued) AS queued, TOTAL(inflight) AS inflight, TOTAL(done) AS done, "
                       "TOTAL(failed) AS failed, TOTAL(retried) AS retried, TOTAL(tokens) AS tokens FROM batches")[0]
        return {k: int(r[k]) for k in ("queued", "inflight", "done", "failed", "retried", "tokens")}


__all__ = ["ENDED", "OPEN", "SCHEMA_VERSION", "Line", "Outcome", "Store", "StoreError", "new_id"]
