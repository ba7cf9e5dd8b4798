"""The batch store's schema and its migrations, one step per version, each in the transaction that sets the version.

Version 2 (issue 36) keeps each batch's counters on its row and indexes lines by ``(batch_id, state, idx)``, so a
claim, a result and the question "has this batch ended" no longer scan the batch. A database of version 1 is
brought forward in place at start (its counters computed once). Version 3 keeps uploaded files in chunks (an upload
and a batch's creation never hold a whole file in memory) and a batch's ``errors`` (a creation that did not finish).
"""

from __future__ import annotations

import sqlite3

from timeslice_verl.log import get_logger

log = get_logger("batch")

SCHEMA_VERSION = 3
V1 = """
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
CREATE INDEX lines_ready ON lines (state, next_at)
"""
V2 = """
ALTER TABLE batches ADD COLUMN queued INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN inflight INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN done INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN failed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN retried INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0;
DROP INDEX lines_ready;
CREATE INDEX lines_todo ON lines (batch_id, state, idx);
UPDATE batches SET
  queued = (SELECT COUNT(*) FROM lines l WHERE l.batch_id = batches.id AND l.state = 'queued'),
  inflight = (SELECT COUNT(*) FROM lines l WHERE l.batch_id = batches.id AND l.state = 'inflight'),
  done = (SELECT COUNT(*) FROM lines l WHERE l.batch_id = batches.id AND l.state = 'done'),
  failed = (SELECT COUNT(*) FROM lines l WHERE l.batch_id = batches.id AND l.state = 'failed'),
  retried = (SELECT TOTAL(MAX(attempts - 1, 0)) FROM lines l WHERE l.batch_id = batches.id),
  tokens = (SELECT TOTAL(tokens) FROM lines l WHERE l.batch_id = batches.id)
"""
V3 = """
CREATE TABLE file_chunks (file_id TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (file_id, seq));
ALTER TABLE batches ADD COLUMN errors TEXT
"""
STEPS = {1: V1, 2: V2, 3: V3}
"""The statements that bring a database of version ``n - 1`` to version ``n``."""


class SchemaError(sqlite3.DatabaseError):
    """A database of a version this one does not know (a newer release's)."""


def migrate(db: sqlite3.Connection, where: str) -> None:
    """Bring ``db`` to :data:`SCHEMA_VERSION`, a step per transaction; refuse a version from the future."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION or version < 0:
        raise SchemaError(f"has schema {version}; this version reads {SCHEMA_VERSION} (and older)")
    if version:
        problem = db.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise SchemaError(f"is damaged (quick_check: {problem}); restore it from a copy or move it away")
    while version < SCHEMA_VERSION:
        version += 1
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in filter(str.strip, STEPS[version].split(";")):
                db.execute(statement)
            db.execute(f"PRAGMA user_version={version}")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        if version > 1:
            log.info("batch: %s brought to schema %d", where, version)


__all__ = ["SCHEMA_VERSION", "SchemaError", "migrate"]
