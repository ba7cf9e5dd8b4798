"""The batch store's two engines behind one small interface: SQLite (embedded, one node: the default) and
PostgreSQL (one queue for a cluster, :mod:`~timeslice_verl.batch.pg`).

The store's SQL is in one catalogue (:mod:`~timeslice_verl.batch.sql`), with ``?`` placeholders and the subset both
engines speak; an engine runs it in a transaction (:meth:`Engine.transaction`) whose rows are mappings, and says
where the two differ (:class:`Dialect`, which fills the catalogue's slots): the database's clock, row locks (``FOR
UPDATE``, ``SKIP LOCKED`` for a claim among feeders of several nodes), how a JSON field is read, how the schema's
version is kept. Both raise :class:`StoreUnavailable` when the database cannot be reached or
written (a full disk, a restarting server): the feeder holds its work and tries again.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from timeslice_verl.batch.schema import ADVISORY_LOCK, SCHEMA_VERSION, SchemaError, migrate_sqlite
from timeslice_verl.batch.sql import catalogue, render
from timeslice_verl.private import NotPrivate, create_private, private_file


class StoreError(RuntimeError):
    """The state is not one this version reads (another schema, corrupt), or cannot be opened."""


class StoreUnavailable(RuntimeError):
    """The database cannot be reached or written just now (a full disk, a lock held too long, a server restarting):
    what was asked did not happen; the same call may be made again."""


@dataclass(frozen=True)
class Dialect:
    """Where the two engines' SQL differ: the fragments that fill the catalogue's ``{slot}``
    (:mod:`~timeslice_verl.batch.sql`), and :meth:`sql`, a statement by name in this engine's text."""

    name: str
    lock: str
    """Appended to a ``SELECT`` that must hold its rows until the commit (PostgreSQL: ``FOR UPDATE``; SQLite's
    ``BEGIN IMMEDIATE`` already holds the whole database)."""
    skip_locked: str
    """Appended to a claim's ``SELECT``: rows another feeder holds are passed over, not waited for."""
    json_code: str
    """The ``code`` field of the JSON text in the column ``error``."""
    shared: bool
    """Several processes, on several nodes, use the database at once (leases decide who holds what)."""
    now: str
    """The database's own time, in seconds since the epoch: leases, retries, creations and uploads are timed on one
    clock, the server's, never the clocks of the nodes."""
    now_s: str
    """:attr:`now` in whole seconds, one value within a statement (the API's ``created_at``, ``expires_at``, ...)."""
    now_us: str
    """:attr:`now` in microseconds (a batch's creation order)."""
    greatest: str
    """The function that gives the larger of two values."""

    def slots(self) -> dict[str, str]:
        return {"lock": self.lock, "skip_locked": self.skip_locked, "json_code": self.json_code, "now": self.now,
                "now_s": self.now_s, "now_us": self.now_us, "greatest": self.greatest,
                "schema_version": str(SCHEMA_VERSION), "advisory_lock": str(ADVISORY_LOCK)}

    def sql(self, name: str) -> str:
        """The catalogue's statement ``name`` in this engine's text."""
        try:
            return _rendered(self)[name]
        except KeyError:
            raise KeyError(f"the batch SQL catalogue has no statement {name!r} for {self.name}") from None


@functools.cache
def _rendered(dialect: Dialect) -> dict[str, str]:
    return render(catalogue(), dialect.name, dialect.slots())


_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
_PG_NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
SQLITE = Dialect("sqlite", "", "", "json_extract(error, '$.code')", shared=False, now=_SQLITE_NOW,
                 now_s="CAST(strftime('%s', 'now') AS INTEGER)",
                 now_us="CAST(((julianday('now') - 2440587.5) * 86400000000.0) AS INTEGER)", greatest="MAX")
POSTGRESQL = Dialect("postgresql", " FOR UPDATE", " FOR UPDATE SKIP LOCKED", "(error::json ->> 'code')", shared=True,
                     now=f"({_PG_NOW}::float8)",
                     now_s="CAST(floor(EXTRACT(EPOCH FROM statement_timestamp())) AS BIGINT)",
                     now_us=f"CAST(floor({_PG_NOW} * 1000000) AS BIGINT)", greatest="GREATEST")


class Tx(Protocol):
    """A transaction as the store uses it."""

    def execute(self, sql: str, args: tuple = ()) -> Any: ...

    def executemany(self, sql: str, rows: list[tuple]) -> Any: ...


class Engine(Protocol):
    dialect: Dialect
    where: str
    """What the logs and errors name (a path, or the server without its password)."""

    def transaction(self) -> contextlib.AbstractContextManager[Tx]: ...

    def query(self, sql: str, args: tuple = ()) -> list[Any]: ...

    def migrate(self) -> None: ...

    def listen(self, wake: Callable[[], None]) -> Closable | None:
        """``wake`` called whenever lines become claimable, from another thread (None: the engine cannot say)."""

    def close(self) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


def _private_db(path: Path) -> None:
    """The database holds every prompt and answer: in a directory only its user writes, readable by nobody else."""
    try:
        create_private(path, "timeslice.batch.db")  # an empty file is an empty SQLite database
        private_file(path, "timeslice.batch.db")
        os.chmod(path, 0o600)  # one of ours made before the service was private
    except NotPrivate as exc:
        raise StoreError(str(exc)) from None


class SqliteEngine:
    """One SQLite connection, serialised by a lock (requests come from FastAPI's threads); WAL, so a committed line
    survives a kill of the service."""

    dialect = SQLITE

    def __init__(self, path: Path) -> None:
        self.path, self.where = path, str(path)
        _private_db(path)
        self._lock = threading.RLock()
        try:
            self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
            self.db.row_factory = sqlite3.Row
            with self._lock:
                self.db.execute(SQLITE.sql("wal"))
                self.db.execute(SQLITE.sql("synchronous"))
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"timeslice.batch.db: {path} cannot be used: {exc}") from None

    def migrate(self) -> None:
        try:
            with self._lock:
                migrate_sqlite(self.db, self.where, SQLITE.sql)
        except (sqlite3.DatabaseError, SchemaError) as exc:
            raise StoreError(f"timeslice.batch.db: {self.path} cannot be used: {exc}") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, unavailable(sqlite3.OperationalError):
            self.db.execute(SQLITE.sql("begin"))
            try:
                yield self.db
            except BaseException:
                if self.db.in_transaction:  # SQLite itself rolls back on some errors (a full disk): keep the cause
                    self.db.execute(SQLITE.sql("rollback"))
                raise
            try:
                self.db.execute(SQLITE.sql("commit"))
            except sqlite3.Error:
                if self.db.in_transaction:
                    self.db.execute(SQLITE.sql("rollback"))
                raise

    def query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock, unavailable(sqlite3.OperationalError):
            return self.db.execute(sql, args).fetchall()

    def listen(self, wake: Callable[[], None]) -> None:
        """One node: the service kicks its own feeders when it creates a batch."""
        return None

    def close(self) -> None:
        with self._lock:
            self.db.close()


@contextlib.contextmanager
def unavailable(*kinds: type[BaseException]) -> Iterator[None]:
    """The engine's own "cannot reach or write the database now" errors, as :class:`StoreUnavailable`."""
    try:
        yield
    except kinds as exc:
        raise StoreUnavailable(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from exc


__all__ = ["Dialect", "Engine", "POSTGRESQL", "SQLITE", "SqliteEngine", "StoreError", "StoreUnavailable", "Tx", "unavailable"]
