"""The batch store's schema: one set of tables both engines create, in the transaction that records its version.

A batch keeps its counters on its row and lines are indexed by ``(batch_id, state, idx)``, so a claim, a result and
the question "has this batch ended" never scan the batch. Uploaded files are kept in chunks. Several nodes may share
one queue: a line in flight has a holder, a lease and a fencing token (an answer from a holder whose lease was taken
over is discarded); a batch has an owner (its API key), a priority, a creation order of its own, a lease while it is
created and the role of the tenants that may answer it (``batch``: users' work; ``policy``: a validation run). A file
has an owner too: a key reaches its owner's files alone.

The statements (``sql/schema.sql``) are written in the SQL both engines speak; :func:`for_postgresql` maps SQLite's type names. SQLite
keeps the version in ``PRAGMA user_version``, PostgreSQL in the table ``timeslice_schema`` (its creation holds an
advisory lock: replicas that start together create it once). The first release's schema (:data:`FIRST_RELEASE`) is
brought to :data:`SCHEMA_VERSION` in place, in one transaction (8: ``lines.partial``, the output a yield cut; 9: what
each batch's lines used of the valleys — tokens in, GPU-seconds, cuts, waits — and ``gpu_usage``; 10: the tokens a
batch's lines ask for at most, ``asked_tokens`` and ``asked_lines``, the ETA's prior for its work). Versions
below it were made by development versions before the first release: there is no way from them, and such a database
is refused with what to do (:data:`DEVELOPMENT_SCHEMA`).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any, Callable

from timeslice_verl.batch.sql import catalogue, render, schema_names
from timeslice_verl.log import get_logger

log = get_logger("batch")

SCHEMA_VERSION = 10
"""This release's schema: the first release's, each line's output kept when a yield cut it (``lines.partial``, 8), the
attribution of the valleys (9: :mod:`~timeslice_verl.batch.usage`), and what each batch's lines ask for (10: the
ETA's prior, :mod:`~timeslice_verl.batch.eta`)."""
FIRST_RELEASE = 7
"""The first release's schema, brought up in place (the numbers below it were development versions', refused)."""
ADVISORY_LOCK = 7_351_038_438
"""PostgreSQL's advisory lock key held while the schema is created (one creation, whatever the replicas)."""
DEVELOPMENT_SCHEMA = ("was made by a development version of timeslice-verl (schema {found}; this release reads schema "
                      "{current} and its first release's only, and there is no way from it). Let its batches end and download their results "
                      "with the version that made it (`timeslice-verl batch results`), then {fresh}: a new one is "
                      "created at start.")
"""What a database of a schema before the first release is told (``fresh``: how to start one, per engine)."""


class SchemaError(RuntimeError):
    """A database this release cannot use: a newer release's, a development version's, or damaged."""


def statements() -> list[str]:
    """The schema's statements (``sql/schema.sql``), one a string, in SQLite's type names, in their order."""
    tables = render({name: catalogue()[name] for name in schema_names()}, "sqlite", {})
    return list(tables.values())


_PG_TYPES = [(r"\bBLOB\b", "BYTEA"), (r"\bREAL\b", "DOUBLE PRECISION"), (r"\bINTEGER\b", "BIGINT")]


def for_postgresql(statement: str) -> str:
    """A statement in PostgreSQL's type names (the SQL is otherwise the same)."""
    for pattern, name in _PG_TYPES:
        statement = re.sub(pattern, name, statement)
    return statement


def _check_version(version: int, fresh: str) -> None:
    if version > SCHEMA_VERSION or version < 0:
        raise SchemaError(f"has schema {version}; this version reads {SCHEMA_VERSION} (and older)")
    if 0 < version < FIRST_RELEASE:
        raise SchemaError(DEVELOPMENT_SCHEMA.format(found=version, current=SCHEMA_VERSION, fresh=fresh))


def migrate_sqlite(db: sqlite3.Connection, where: str, sql: Callable[[str], str]) -> None:
    """Create the schema in a new SQLite database; check an existing one's version (and that it is whole). ``sql``:
    a statement of the catalogue by name, in SQLite's text."""
    version = db.execute(sql("schema_version")).fetchone()[0]
    _check_version(version, f"move {where} away (or point timeslice.batch.db elsewhere)")
    if version:
        problem = db.execute(sql("quick_check")).fetchone()[0]
        if problem != "ok":
            raise SchemaError(f"is damaged (quick_check: {problem}); restore it from a copy or move it away")
        if version == SCHEMA_VERSION:
            return
    db.execute(sql("begin"))
    try:
        for statement in _steps(version, sql):
            db.execute(statement)
        db.execute(sql("set_schema_version"))
    except BaseException:
        if db.in_transaction:
            db.execute(sql("rollback"))
        raise
    db.execute(sql("commit"))
    log.info("batch: %s: %s schema v%d", where, "brought to" if version else "created", SCHEMA_VERSION)


def _steps(version: int, sql: Callable[[str], str]) -> list[str]:
    """The statements that make a database of ``version`` (0: new) this release's, in SQLite's type names."""
    if not version:
        return statements()
    to_8 = [sql("lines_partial_column")] if version < 8 else []  # FIRST_RELEASE → 8, then 8 → 9, then 9 → 10
    to_9 = [sql("lines_sends_column"), sql("batches_prompt_tokens_column"), sql("batches_gpu_s_column"),
            sql("batches_cuts_column"), sql("batches_first_sent_at_column"), sql("batches_wait_s_column"),
            sql("batches_sent_lines_column"), sql("create_gpu_usage")] if version < 9 else []
    return to_8 + to_9 + [sql("batches_asked_tokens_column"), sql("batches_asked_lines_column")]


def migrate_postgresql(conn: Any, where: str, sql: Callable[[str], str]) -> None:
    """Create the schema in a new PostgreSQL database under the advisory lock (replicas that start together wait for
    the first); check an existing one's version. ``sql``: a statement of the catalogue by name, in PostgreSQL's text
    (none takes a parameter)."""
    with conn.transaction():
        conn.execute(sql("schema_lock"))
        conn.execute(sql("create_schema_version"))
        row = conn.execute(sql("schema_version")).fetchone()
        version = int(row["version"]) if row else 0
        _check_version(version, "drop its tables (files, file_chunks, batches, lines, gpu_usage, timeslice_schema) "
                                "or give TIMESLICE_BATCH_DSN a new database")
        if version == SCHEMA_VERSION:
            return
        for statement in _steps(version, sql):
            conn.execute(for_postgresql(statement))
        conn.execute(sql("update_schema_version" if version else "set_schema_version"))
    log.info("batch: %s: %s schema v%d", where, "brought to" if version else "created", SCHEMA_VERSION)


__all__ = ["ADVISORY_LOCK", "FIRST_RELEASE", "SCHEMA_VERSION", "SchemaError", "for_postgresql", "migrate_postgresql", "migrate_sqlite", "statements"]
