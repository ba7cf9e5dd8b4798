"""The batch store's schema and its migrations — one list of steps both engines run, each step in the transaction
that sets the version.

Version 2 (issue 36) keeps each batch's counters on its row and indexes lines by ``(batch_id, state, idx)``, so a
claim, a result and the question "has this batch ended" no longer scan the batch. Version 3 keeps uploaded files in
chunks and a batch's ``errors`` (a creation that did not finish). Version 4 (issue 38) lets several nodes share one
queue: a line in flight has a holder, a lease and a fencing token (an answer from a holder whose lease was taken
over is discarded); a batch has an owner (its API key), a priority, a creation order of its own and a lease while
it is created; a file's chunks say when they were written (an upload that stopped is swept, not one under way).
Version 5 (issue 39) gives a batch the role of the tenants that may answer it (``batch``: users' work; ``policy``:
a validation run, answered only by the policy tenant). Version 6 gives a file an owner (the owner its API key names):
a key reaches its owner's files alone. Files of an older database get the owner ``''``, as batches made before
version 4 did: nobody's, so only an ``admin`` key reaches them (who uploaded them is not known).

The steps are written in the SQL both engines speak; :func:`for_postgresql` maps SQLite's type names. SQLite keeps
its version in ``PRAGMA user_version``, PostgreSQL in the table ``timeslice_schema`` (the migration holds an advisory
lock: replicas that start together migrate once).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from timeslice_verl.log import get_logger

log = get_logger("batch")

SCHEMA_VERSION = 6
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
  retried = (SELECT COALESCE(SUM(CASE WHEN attempts > 1 THEN attempts - 1 ELSE 0 END), 0) FROM lines l
             WHERE l.batch_id = batches.id),
  tokens = (SELECT COALESCE(SUM(tokens), 0) FROM lines l WHERE l.batch_id = batches.id)
"""
V3 = """
CREATE TABLE file_chunks (file_id TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (file_id, seq));
ALTER TABLE batches ADD COLUMN errors TEXT
"""
V4 = """
ALTER TABLE lines ADD COLUMN holder TEXT;
ALTER TABLE lines ADD COLUMN lease_until REAL NOT NULL DEFAULT 0;
ALTER TABLE lines ADD COLUMN token INTEGER NOT NULL DEFAULT 0;
CREATE INDEX lines_held ON lines (holder) WHERE state = 'inflight';
ALTER TABLE batches ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE batches ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN seq INTEGER NOT NULL DEFAULT 0;
ALTER TABLE batches ADD COLUMN creating_until REAL NOT NULL DEFAULT 0;
CREATE INDEX batches_open ON batches (status, priority, seq);
ALTER TABLE file_chunks ADD COLUMN at REAL NOT NULL DEFAULT 0
"""
V5 = """
ALTER TABLE batches ADD COLUMN tenant_role TEXT NOT NULL DEFAULT 'batch'
"""
V6 = """
ALTER TABLE files ADD COLUMN owner TEXT NOT NULL DEFAULT ''
"""
STEPS = {1: V1, 2: V2, 3: V3, 4: V4, 5: V5, 6: V6}
"""The statements that bring a database of version ``n - 1`` to version ``n``."""
SQLITE_ONLY = {4: ["UPDATE batches SET seq = rowid"]}
"""What a step does on SQLite alone (before version 4 the creation order was SQLite's ``rowid``)."""
ADVISORY_LOCK = 7_351_038_438
"""PostgreSQL's advisory lock key held while the schema moves (one migration, whatever the replicas)."""


class SchemaError(RuntimeError):
    """A database of a version this one does not know (a newer release's), or damaged."""


def statements(version: int) -> list[str]:
    return [s.strip() for s in STEPS[version].split(";") if s.strip()]


_PG_TYPES = [(r"\bBLOB\b", "BYTEA"), (r"\bREAL\b", "DOUBLE PRECISION"), (r"\bINTEGER\b", "BIGINT")]


def for_postgresql(statement: str) -> str:
    """A step's statement in PostgreSQL's type names (the SQL is otherwise the same)."""
    for pattern, name in _PG_TYPES:
        statement = re.sub(pattern, name, statement)
    return statement


def _check_version(version: int) -> None:
    if version > SCHEMA_VERSION or version < 0:
        raise SchemaError(f"has schema {version}; this version reads {SCHEMA_VERSION} (and older)")


def migrate_sqlite(db: sqlite3.Connection, where: str) -> None:
    """Bring an SQLite database to :data:`SCHEMA_VERSION`, a step per transaction; refuse a version from the future."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    _check_version(version)
    if version:
        problem = db.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise SchemaError(f"is damaged (quick_check: {problem}); restore it from a copy or move it away")
    fresh = version == 0
    while version < SCHEMA_VERSION:
        version += 1
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in [*statements(version), *SQLITE_ONLY.get(version, [])]:
                db.execute(statement)
            db.execute(f"PRAGMA user_version={version}")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        if not fresh:
            log.info("batch: %s brought to schema %d", where, version)
    if fresh:
        log.info("batch: %s: created schema v%d", where, SCHEMA_VERSION)


def migrate_postgresql(conn: Any, where: str) -> None:
    """Bring a PostgreSQL database to :data:`SCHEMA_VERSION`, each step in a transaction under the advisory lock."""
    found: int | None = None  # the version this process found first
    made = 0  # the steps this process made (a replica starting beside it may make some)
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS timeslice_schema (version BIGINT NOT NULL)")
            row = conn.execute("SELECT version FROM timeslice_schema").fetchone()
            version = int(row["version"]) if row else 0
            _check_version(version)
            found = version if found is None else found
            if version == SCHEMA_VERSION:
                if found == 0 and made == SCHEMA_VERSION:
                    log.info("batch: %s: created schema v%d", where, SCHEMA_VERSION)
                return
            version += 1
            for statement in statements(version):
                conn.execute(for_postgresql(statement))
            conn.execute("DELETE FROM timeslice_schema")
            conn.execute("INSERT INTO timeslice_schema (version) VALUES (%s)", (version,))
        made += 1
        if found:
            log.info("batch: %s brought to schema %d", where, version)


__all__ = ["SCHEMA_VERSION", "SchemaError", "for_postgresql", "migrate_postgresql", "migrate_sqlite", "statements"]
