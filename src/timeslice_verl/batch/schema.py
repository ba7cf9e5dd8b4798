"""The batch store's schema: one set of tables both engines create, in the transaction that records its version.

A batch keeps its counters on its row and lines are indexed by ``(batch_id, state, idx)``, so a claim, a result and
the question "has this batch ended" never scan the batch. Uploaded files are kept in chunks. Several nodes may share
one queue: a line in flight has a holder, a lease and a fencing token (an answer from a holder whose lease was taken
over is discarded); a batch has an owner (its API key), a priority, a creation order of its own, a lease while it is
created and the role of the tenants that may answer it (``batch``: users' work; ``policy``: a validation run). A file
has an owner too: a key reaches its owner's files alone.

The statements are written in the SQL both engines speak; :func:`for_postgresql` maps SQLite's type names. SQLite
keeps the version in ``PRAGMA user_version``, PostgreSQL in the table ``timeslice_schema`` (its creation holds an
advisory lock: replicas that start together create it once). Versions below :data:`SCHEMA_VERSION` were made by
development versions before the first release: there is no way from them, and such a database is refused with what
to do (:data:`DEVELOPMENT_SCHEMA`).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from timeslice_verl.log import get_logger

log = get_logger("batch")

SCHEMA_VERSION = 7
"""The first release's schema (the numbers below it were development versions' schemas, refused)."""
TABLES = """
CREATE TABLE files (
  id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
  created_at INTEGER NOT NULL, owner TEXT NOT NULL DEFAULT '');
CREATE TABLE file_chunks (
  file_id TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, at REAL NOT NULL DEFAULT 0,
  PRIMARY KEY (file_id, seq));
CREATE TABLE batches (
  id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
  status TEXT NOT NULL, metadata TEXT, errors TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
  in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
  expired_at INTEGER, failed_at INTEGER, total INTEGER NOT NULL,
  queued INTEGER NOT NULL DEFAULT 0, inflight INTEGER NOT NULL DEFAULT 0, done INTEGER NOT NULL DEFAULT 0,
  failed INTEGER NOT NULL DEFAULT 0, retried INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
  owner TEXT NOT NULL DEFAULT '', priority INTEGER NOT NULL DEFAULT 0, seq INTEGER NOT NULL DEFAULT 0,
  creating_until REAL NOT NULL DEFAULT 0, tenant_role TEXT NOT NULL DEFAULT 'batch');
CREATE INDEX batches_open ON batches (status, priority, seq);
CREATE TABLE lines (
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body TEXT, state TEXT NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL DEFAULT 0, response TEXT, error TEXT,
  tokens INTEGER NOT NULL DEFAULT 0, done_at REAL,
  holder TEXT, lease_until REAL NOT NULL DEFAULT 0, token INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (batch_id, idx));
CREATE INDEX lines_todo ON lines (batch_id, state, idx);
CREATE INDEX lines_held ON lines (holder) WHERE state = 'inflight'
"""
ADVISORY_LOCK = 7_351_038_438
"""PostgreSQL's advisory lock key held while the schema is created (one creation, whatever the replicas)."""
DEVELOPMENT_SCHEMA = ("was made by a development version of timeslice-verl (schema {found}; this release reads schema "
                      "{current} only, and there is no way from it). Let its batches end and download their results "
                      "with the version that made it (`timeslice-verl batch results`), then {fresh}: a new one is "
                      "created at start.")
"""What a database of a schema before the first release is told (``fresh``: how to start one, per engine)."""


class SchemaError(RuntimeError):
    """A database this release cannot use: a newer release's, a development version's, or damaged."""


def statements() -> list[str]:
    """The schema's statements, one a string, in SQLite's type names."""
    return [s.strip() for s in TABLES.split(";") if s.strip()]


_PG_TYPES = [(r"\bBLOB\b", "BYTEA"), (r"\bREAL\b", "DOUBLE PRECISION"), (r"\bINTEGER\b", "BIGINT")]


def for_postgresql(statement: str) -> str:
    """A statement in PostgreSQL's type names (the SQL is otherwise the same)."""
    for pattern, name in _PG_TYPES:
        statement = re.sub(pattern, name, statement)
    return statement


def _check_version(version: int, fresh: str) -> None:
    if version > SCHEMA_VERSION or version < 0:
        raise SchemaError(f"has schema {version}; this version reads {SCHEMA_VERSION} (and older)")
    if 0 < version < SCHEMA_VERSION:
        raise SchemaError(DEVELOPMENT_SCHEMA.format(found=version, current=SCHEMA_VERSION, fresh=fresh))


def migrate_sqlite(db: sqlite3.Connection, where: str) -> None:
    """Create the schema in a new SQLite database; check an existing one's version (and that it is whole)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    _check_version(version, f"move {where} away (or point timeslice.batch.db elsewhere)")
    if version:
        problem = db.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise SchemaError(f"is damaged (quick_check: {problem}); restore it from a copy or move it away")
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        for statement in statements():
            db.execute(statement)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    log.info("batch: %s: created schema v%d", where, SCHEMA_VERSION)


def migrate_postgresql(conn: Any, where: str) -> None:
    """Create the schema in a new PostgreSQL database under the advisory lock (replicas that start together wait for
    the first); check an existing one's version."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS timeslice_schema (version BIGINT NOT NULL)")
        row = conn.execute("SELECT version FROM timeslice_schema").fetchone()
        version = int(row["version"]) if row else 0
        _check_version(version, "drop its tables (files, file_chunks, batches, lines, timeslice_schema) or give "
                                "TIMESLICE_BATCH_DSN a new database")
        if version == SCHEMA_VERSION:
            return
        for statement in statements():
            conn.execute(for_postgresql(statement))
        conn.execute("INSERT INTO timeslice_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
    log.info("batch: %s: created schema v%d", where, SCHEMA_VERSION)


__all__ = ["SCHEMA_VERSION", "SchemaError", "for_postgresql", "migrate_postgresql", "migrate_sqlite", "statements"]
