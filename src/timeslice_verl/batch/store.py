"""The batch service's state: one SQLite file (WAL), a schema version, every line's fate in one row.

A line is ``queued`` (waiting, maybe until ``next_at`` after a failed try), ``inflight`` (sent to the tenant), ``done``
(its response recorded) or ``failed`` (its error recorded). A line's response or error is written in the same
transaction that ends it, so the output and error files — made from these rows when downloaded — hold every
``custom_id`` of a batch exactly once, also after a ``kill -9``: lines found ``inflight`` at start go back to the
queue (a request whose answer was lost is asked again; only an answer that was recorded counts).
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
from typing import Any, Iterator

from timeslice_verl.private import NotPrivate, create_private, private_file

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE files (
  id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
  created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE batches (
  id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
  status TEXT NOT NULL, metadata TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
  in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
  expired_at INTEGER, failed_at INTEGER, total INTEGER NOT NULL);
CREATE TABLE lines (
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body TEXT, state TEXT NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL DEFAULT 0, response TEXT, error TEXT,
  tokens INTEGER NOT NULL DEFAULT 0, done_at REAL, PRIMARY KEY (batch_id, idx));
CREATE INDEX lines_ready ON lines (state, next_at);
"""
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")


class StoreError(RuntimeError):
    """The state file is not one this version reads (another schema), or cannot be opened."""


@dataclass(frozen=True)
class Line:
    batch_id: str
    idx: int
    custom_id: str
    body: dict[str, Any]
    attempts: int
    endpoint: str


def _private_db(path: Path) -> None:
    """The database holds every prompt and answer: in a directory only its user writes, readable by nobody else."""
    try:
        create_private(path, "timeslice.batch.db")  # an empty file is an empty SQLite database
        private_file(path, "timeslice.batch.db")
        os.chmod(path, 0o600)  # one of ours made before the service was private
    except NotPrivate as exc:
        raise StoreError(str(exc)) from None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class Store:
    """The service's one SQLite connection, serialised by a lock (requests come from FastAPI's threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        _private_db(path)
        self._lock = threading.RLock()
        try:
            self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        except sqlite3.Error as exc:
            raise StoreError(f"timeslice.batch.db: cannot open {path}: {exc}") from None
        self.db.row_factory = sqlite3.Row
        with self._lock:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: a committed line survives a kill of the service
            self._migrate()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version != 0:
            raise StoreError(f"timeslice.batch.db: {self.path} has schema {version}; this version reads {SCHEMA_VERSION}")
        with self.transaction():
            for statement in filter(str.strip, SCHEMA.split(";")):
                self.db.execute(statement)
            self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self.db.close()

    # ------------------------------------------------------------------ files

    def add_file(self, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        fid = new_id("file")
        with self.transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", (fid, purpose, filename, len(content), int(time.time()),
                                                                         content))
        return self.file(fid)  # type: ignore[return-value]

    def file(self, fid: str) -> dict[str, Any] | None:
        rows = self.query("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?", (fid,))
        return dict(rows[0]) if rows else None

    def files(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.query("SELECT id, purpose, filename, bytes, created_at FROM files ORDER BY created_at")]

    def content(self, fid: str) -> bytes | None:
        rows = self.query("SELECT content FROM files WHERE id = ?", (fid,))
        return bytes(rows[0]["content"]) if rows else None

    def delete_file(self, fid: str) -> bool:
        with self.transaction() as db:
            return db.execute("DELETE FROM files WHERE id = ?", (fid,)).rowcount > 0

    # ------------------------------------------------------------------ batches

    def create_batch(self, endpoint: str, input_file_id: str, window_s: int, window: str, metadata: Any,
                     lines: list[tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]]) -> str:
        """A batch of ``lines``: ``(custom_id, body, error)`` each; a line with an error is failed from the start."""
        bid, now = new_id("batch"), int(time.time())
        with self.transaction() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, created_at, "
                       "expires_at, in_progress_at, total) VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, ?)",
                       (bid, endpoint, input_file_id, window, json.dumps(metadata) if metadata else None, now,
                        now + window_s, now, len(lines)))
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, body, state, error) VALUES (?, ?, ?, ?, ?, ?)", [
                (bid, i, cid, json.dumps(body) if body is not None else None, "failed" if err else "queued",
                 json.dumps(err) if err else None) for i, (cid, body, err) in enumerate(lines)])
        self.settle(bid)
        return bid

    def batch(self, bid: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM batches WHERE id = ?", (bid,))
        return dict(rows[0]) if rows else None

    def batches(self, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM batches", ()
        if after:
            sql, args = sql + " WHERE created_at < (SELECT created_at FROM batches WHERE id = ?) OR " \
                        "(created_at = (SELECT created_at FROM batches WHERE id = ?) AND id < ?)", (after, after, after)
        return [dict(r) for r in self.query(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit))]

    def counts(self, bid: str) -> dict[str, int]:
        rows = self.query("SELECT state, COUNT(*) AS n FROM lines WHERE batch_id = ? GROUP BY state", (bid,))
        by = {r["state"]: r["n"] for r in rows}
        return {"queued": by.get("queued", 0), "inflight": by.get("inflight", 0), "completed": by.get("done", 0),
                "failed": by.get("failed", 0)}

    def cancel(self, bid: str) -> bool:
        with self.transaction() as db:
            moved = db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND status IN "
                               "('validating', 'in_progress')", (int(time.time()), bid)).rowcount
        self.settle(bid)
        return moved > 0

    def settle(self, bid: str) -> None:
        """End the batch when nothing of it waits or runs: completed; or cancelled, or expired past its window, with
        the lines never sent failed as such (each ``custom_id`` still appears once)."""
        now = int(time.time())
        with self.transaction() as db:
            row = db.execute("SELECT status, expires_at, expired_at FROM batches WHERE id = ?", (bid,)).fetchone()
            if row is None or row["status"] in ENDED:
                return
            status, expired = row["status"], row["expired_at"] is not None
            if status == "in_progress" and now >= row["expires_at"]:
                db.execute("UPDATE batches SET status = 'cancelling', expired_at = ? WHERE id = ?", (now, bid))
                status, expired = "cancelling", True
            what = "expired" if expired else "cancelled"
            if status == "cancelling":
                err = json.dumps({"code": f"batch_{what}", "message": f"the batch was {what} before this request was sent"})
                db.execute("UPDATE lines SET state = 'failed', error = ? WHERE batch_id = ? AND state = 'queued'", (err, bid))
            busy = db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND state IN ('queued', 'inflight')",
                              (bid,)).fetchone()[0]
            if busy:
                return
            if status == "cancelling":
                db.execute(f"UPDATE batches SET status = ?, {what}_at = ? WHERE id = ?", (what, now, bid))
            else:
                db.execute("UPDATE batches SET status = 'completed', finalizing_at = ?, completed_at = ? WHERE id = ?",
                           (now, now, bid))

    # ------------------------------------------------------------------ lines

    def recover(self) -> int:
        """At start: lines a killed service left in flight go back to the queue."""
        with self.transaction() as db:
            return db.execute("UPDATE lines SET state = 'queued', next_at = 0 WHERE state = 'inflight'").rowcount

    def claim(self, n: int, now: float) -> list[Line]:
        """Up to ``n`` lines ready to send, oldest batch first, marked in flight (one more try each)."""
        if n <= 0:
            return []
        with self.transaction() as db:
            rows = db.execute(
                "SELECT l.batch_id, l.idx, l.custom_id, l.body, l.attempts, b.endpoint FROM lines l JOIN batches b ON "
                "b.id = l.batch_id WHERE l.state = 'queued' AND l.next_at <= ? AND b.status = 'in_progress' ORDER BY "
                "b.created_at, l.batch_id, l.idx LIMIT ?", (now, n)).fetchall()
            db.executemany("UPDATE lines SET state = 'inflight', attempts = attempts + 1 WHERE batch_id = ? AND idx = ?",
                           [(r["batch_id"], r["idx"]) for r in rows])
        return [Line(r["batch_id"], r["idx"], r["custom_id"], json.loads(r["body"]), r["attempts"] + 1, r["endpoint"])
                for r in rows]

    def done(self, line: Line, response: dict[str, Any], tokens: int) -> None:
        with self.transaction() as db:
            db.execute("UPDATE lines SET state = 'done', response = ?, tokens = ?, done_at = ? WHERE batch_id = ? AND idx = ? "
                       "AND state = 'inflight'", (json.dumps(response), tokens, time.time(), line.batch_id, line.idx))
        self.settle(line.batch_id)

    def again(self, line: Line, delay_s: float) -> None:
        with self.transaction() as db:
            db.execute("UPDATE lines SET state = 'queued', next_at = ? WHERE batch_id = ? AND idx = ? AND state = 'inflight'",
                       (time.time() + delay_s, line.batch_id, line.idx))
        self.settle(line.batch_id)

    def failed(self, line: Line, error: dict[str, Any], response: dict[str, Any] | None = None) -> None:
        with self.transaction() as db:
            db.execute("UPDATE lines SET state = 'failed', error = ?, response = ? WHERE batch_id = ? AND idx = ? AND "
                       "state = 'inflight'", (json.dumps(error), json.dumps(response) if response else None,
                                              line.batch_id, line.idx))
        self.settle(line.batch_id)

    def results(self, bid: str, state: str) -> Iterator[sqlite3.Row]:
        """The ended lines of a batch in input order (``done``: the output file, ``failed``: the error file)."""
        return iter(self.query("SELECT idx, custom_id, response, error FROM lines WHERE batch_id = ? AND state = ? "
                               "ORDER BY idx", (bid, state)))

    def figures(self, bid: str) -> dict[str, Any]:
        """One batch's lines by fate: completed, failed by error code, the tries beyond each line's first, tokens."""
        rows = self.query("SELECT state, COUNT(*) AS n, SUM(MAX(attempts - 1, 0)) AS retried, SUM(tokens) AS tokens, "
                          "json_extract(error, '$.code') AS code FROM lines WHERE batch_id = ? GROUP BY state, code", (bid,))
        out: dict[str, Any] = {"completed": 0, "failed": {}, "retried": 0, "tokens": 0, "open": 0}
        for r in rows:
            if r["state"] == "done":
                out["completed"] += r["n"]
            elif r["state"] == "failed":
                out["failed"][r["code"] or "unknown"] = r["n"]
            else:
                out["open"] += r["n"]
            out["retried"] += r["retried"] or 0
            out["tokens"] += r["tokens"] or 0
        return out

    def totals(self) -> dict[str, int]:
        """Lines by state, over every batch; ``retried``: the tries beyond each line's first; ``tokens`` generated."""
        rows = self.query("SELECT state, COUNT(*) AS n, SUM(MAX(attempts - 1, 0)) AS retried, SUM(tokens) AS tokens "
                          "FROM lines GROUP BY state")
        out = {"queued": 0, "inflight": 0, "done": 0, "failed": 0, "retried": 0, "tokens": 0}
        for r in rows:
            out[r["state"]] = r["n"]
            out["retried"] += r["retried"] or 0
            out["tokens"] += r["tokens"] or 0
        return out


__all__ = ["ENDED", "OPEN", "SCHEMA_VERSION", "Line", "Store", "StoreError", "new_id"]
