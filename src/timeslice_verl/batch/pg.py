"""The batch store on PostgreSQL: one queue for every node of a cluster (``timeslice.batch.store=postgresql``).

The DSN never travels on a command line: it is read from ``TIMESLICE_BATCH_DSN`` or from a file only its user can
read (``timeslice.batch.dsn_file``; a Kubernetes Secret mounted, or given as the variable). psycopg 3 with a pool:
each call takes a connection checked on the way out of the pool, so a server that restarted is reconnected to, and
while it is down a call raises :class:`~timeslice_verl.batch.engine.StoreUnavailable` (the feeder holds its lines,
the API answers 503) instead of failing for good.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from timeslice_verl.batch.engine import POSTGRESQL, StoreError, StoreUnavailable, unavailable
from timeslice_verl.batch.schema import SchemaError, migrate_postgresql
from timeslice_verl.private import NotPrivate, private_file

DSN_ENV = "TIMESLICE_BATCH_DSN"
POOL_TIMEOUT_S = 5.0
"""How long a call waits for a connection (the server restarting) before it is told the store is unavailable."""


def read_dsn(dsn_file: str) -> tuple[str, str]:
    """The DSN and where it came from: ``TIMESLICE_BATCH_DSN``, else ``timeslice.batch.dsn_file`` (private)."""
    if os.environ.get(DSN_ENV):
        return os.environ[DSN_ENV].strip(), DSN_ENV
    if not dsn_file:
        raise StoreError(f"timeslice.batch.store=postgresql needs its DSN: set {DSN_ENV}, or timeslice.batch.dsn_file "
                         "to a file only you can read (never the DSN itself on a command line)")
    path = Path(dsn_file).expanduser()
    try:
        if not private_file(path, "timeslice.batch.dsn_file", readable_by_others=False):
            raise StoreError(f"timeslice.batch.dsn_file: {path} does not exist")
        return path.read_text().strip(), str(path)
    except NotPrivate as exc:
        raise StoreError(str(exc)) from None


def shown(dsn: str) -> str:
    """The server and database a DSN names, without its password (what logs and errors say)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001 - a DSN the driver cannot read is refused when the pool connects
        return "postgresql (an unreadable DSN)"
    return f"postgresql://{parts.get('user', '')}@{parts.get('host', '')}:{parts.get('port', '5432')}/{parts.get('dbname', '')}"


class _Tx:
    """A transaction's connection, taking the store's ``?`` placeholders."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def execute(self, sql: str, args: tuple = ()) -> Any:
        return self.conn.execute(_pg(sql), args)

    def executemany(self, sql: str, rows: list[tuple]) -> Any:
        cur = self.conn.cursor()
        cur.executemany(_pg(sql), rows)
        return cur


_SQL: dict[str, str] = {}


def _pg(sql: str) -> str:
    """``?`` → ``%s`` (the store's SQL has no ``?`` or ``%`` of its own)."""
    out = _SQL.get(sql)
    if out is None:
        out = _SQL[sql] = sql.replace("%", "%%").replace("?", "%s")
    return out


class PostgresEngine:
    dialect = POSTGRESQL

    def __init__(self, dsn: str, *, max_size: int = 8) -> None:
        import psycopg
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        self.where = shown(dsn)
        self._errors = (psycopg.OperationalError, psycopg.InterfaceError)
        self.pool = ConnectionPool(dsn, min_size=1, max_size=max_size, timeout=POOL_TIMEOUT_S, open=False,
                                   kwargs={"row_factory": dict_row, "autocommit": True},
                                   check=ConnectionPool.check_connection, name="timeslice-batch")
        try:
            self.pool.open(wait=True, timeout=POOL_TIMEOUT_S * 2)
        except Exception as exc:  # noqa: BLE001 - a wrong DSN, a server not there: said with where, never the password
            self.pool.close()
            raise StoreError(f"timeslice.batch.store: cannot connect to {self.where}: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from None

    def migrate(self) -> None:
        try:
            with self.pool.connection() as conn:
                migrate_postgresql(conn, self.where)
        except SchemaError as exc:
            raise StoreError(f"timeslice.batch.store: {self.where} {exc}") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Tx]:
        with unavailable(*self._errors), self.pool.connection() as conn, conn.transaction():
            yield _Tx(conn)

    def query(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with unavailable(*self._errors), self.pool.connection() as conn:
            return conn.execute(_pg(sql), args).fetchall()

    def close(self) -> None:
        self.pool.close()


def open_postgresql(dsn_file: str) -> PostgresEngine:
    dsn, _ = read_dsn(dsn_file)
    return PostgresEngine(dsn)


__all__ = ["DSN_ENV", "PostgresEngine", "StoreUnavailable", "open_postgresql", "read_dsn", "shown"]
