"""The batch store on PostgreSQL: one queue for every node of a cluster (``timeslice.batch.store=postgresql``).

The DSN never travels on a command line: it is read from ``TIMESLICE_BATCH_DSN`` or from a file only its user can
read (``timeslice.batch.dsn_file``; a Kubernetes Secret mounted, or given as the variable). psycopg 3 with a pool:
each call takes a connection checked on the way out of the pool, so a server that restarted is reconnected to, and
while it is down a call raises :class:`~timeslice_verl.batch.engine.StoreUnavailable` (the feeder holds its lines,
the API answers 503) instead of failing for good.

Every wait has a bound (``timeslice.batch.postgresql``): the server ends a long statement, a long lock wait and a
connection idle inside a transaction (a feeder frozen there: its locks are released, and once it resumes it
reconnects); the client cuts a connection whose server does not answer at all (:mod:`~timeslice_verl.batch.pgwatch`),
and TCP keepalives notice a peer gone. The DSN's password is kept out of every log and warning
(:mod:`~timeslice_verl.batch.redact`).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from timeslice_verl.batch.engine import POSTGRESQL, StoreError, StoreUnavailable
from timeslice_verl.batch.pgnotify import Listener
from timeslice_verl.batch.pgwatch import Watch, Watchdog
from timeslice_verl.batch.redact import protect, redact
from timeslice_verl.batch.schema import SchemaError, migrate_postgresql
from timeslice_verl.config.pg_bounds import PostgresBounds
from timeslice_verl.private import NotPrivate, private_file

DSN_ENV = "TIMESLICE_BATCH_DSN"


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


GRACE_S = 2.0
"""How much longer than ``statement_timeout`` the client waits for the server's answer before it cuts the connection
(the server sends its own time-out first when it runs)."""


class _Tx:
    """A transaction's connection, taking the store's ``?`` placeholders; each statement under the watchdog."""

    def __init__(self, conn: Any, watch: Watch) -> None:
        self.conn, self.watch = conn, watch

    def execute(self, sql: str, args: tuple = ()) -> Any:
        self.watch.beat()
        return self.conn.execute(_pg(sql), args)

    def executemany(self, sql: str, rows: list[tuple]) -> Any:
        """Many rows in one pipeline; then one plain statement: a connection left idle in a transaction right after a
        pipeline is never ended by the server (``idle_in_transaction_session_timeout``; PostgreSQL 15, psycopg 3.3),
        one after a plain statement is."""
        self.watch.beat()
        cur = self.conn.cursor()
        cur.executemany(_pg(sql), rows)
        self.conn.execute(POSTGRESQL.sql("ping"))
        return cur


_SQL: dict[str, str] = {}


def _pg(sql: str) -> str:
    """``?`` → ``%s`` (the store's SQL has no ``?`` or ``%`` of its own)."""
    out = _SQL.get(sql)
    if out is None:
        out = _SQL[sql] = sql.replace("%", "%%").replace("?", "%s")
    return out


def connect_options(bounds: PostgresBounds) -> dict[str, Any]:
    """libpq's options for ``bounds``: a connection made in time, a silent peer noticed (TCP; a Unix socket has none)."""
    idle = max(1, round(bounds.keepalive_s))
    return {"connect_timeout": max(2, math.ceil(bounds.connect_timeout_s)), "keepalives": 1, "keepalives_idle": idle,
            "keepalives_interval": max(1, round(bounds.keepalive_s / 3)), "keepalives_count": 3,
            "tcp_user_timeout": int(bounds.keepalive_s * 1000)}


def server_settings(bounds: PostgresBounds) -> dict[str, str]:
    """The server's settings for each connection: no statement, lock wait or idle transaction without a bound."""
    ms = lambda s: f"{max(1, int(s * 1000))}ms"  # noqa: E731
    return {"statement_timeout": ms(bounds.statement_timeout_s), "lock_timeout": ms(bounds.lock_timeout_s),
            "idle_in_transaction_session_timeout": ms(bounds.idle_in_transaction_s),
            "tcp_keepalives_idle": str(max(1, round(bounds.keepalive_s))),
            "tcp_keepalives_interval": str(max(1, round(bounds.keepalive_s / 3))), "tcp_keepalives_count": "3"}


class PostgresEngine:
    dialect = POSTGRESQL

    def __init__(self, dsn: str, *, max_size: int = 8, bounds: PostgresBounds | None = None) -> None:
        import psycopg
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        protect(dsn)  # before the pool's first try: what it logs of a DSN it cannot read hides the password
        self.where, self._dsn = shown(dsn), dsn
        self.bounds = bounds or PostgresBounds()
        self.watchdog = Watchdog(self.where)
        self._settings = server_settings(self.bounds)
        self._errors = (psycopg.OperationalError, psycopg.InterfaceError,
                        psycopg.errors.IdleInTransactionSessionTimeout)  # a connection the server ended (frozen): again
        self.pool = ConnectionPool(dsn, min_size=1, max_size=max_size, timeout=self.bounds.pool_timeout_s, open=False,
                                   kwargs={"row_factory": dict_row, "autocommit": True, **connect_options(self.bounds)},
                                   configure=self._configure, check=self._check, name="timeslice-batch")
        try:
            self.pool.open(wait=True, timeout=self.bounds.pool_timeout_s * 2)
        except Exception as exc:  # noqa: BLE001 - a wrong DSN, a server not there: said with where, never the password
            self.pool.close()
            self.watchdog.close()
            raise StoreError(f"timeslice.batch.store: cannot connect to {self.where}: {type(exc).__name__}: "
                             f"{redact(str(exc).splitlines()[0]) if str(exc) else ''}") from None

    def _configure(self, conn: Any, settings: dict[str, str] | None = None) -> None:
        """Each new connection's server settings (``settings``: others, for a while)."""
        pairs = settings or self._settings
        with self.watchdog.watch(conn, self.bounds.connect_timeout_s + GRACE_S):
            conn.execute(_pg(POSTGRESQL.sql("configure")), (list(pairs), list(pairs.values())))

    def _check(self, conn: Any) -> None:
        """A pooled connection answers before a call gets it, within ``connect_timeout_s`` (a stopped server does not)."""
        from psycopg_pool import ConnectionPool

        with self.watchdog.watch(conn, self.bounds.connect_timeout_s):
            ConnectionPool.check_connection(conn)

    def migrate(self) -> None:
        """The schema brought up to date: a step may take long, and replicas that start together wait for the first."""
        try:
            with self.pool.connection() as conn:
                self._configure(conn, {"statement_timeout": "0", "lock_timeout": "0"})
                try:
                    migrate_postgresql(conn, self.where, POSTGRESQL.sql)
                finally:
                    self._configure(conn)
        except SchemaError as exc:
            raise StoreError(f"timeslice.batch.store: {self.where} {exc}") from None

    @contextlib.contextmanager
    def _call(self) -> Iterator[Any]:
        """A pooled connection under the watchdog; the driver's errors as :class:`StoreUnavailable`, said safely."""
        watch = None
        try:
            with self.pool.connection() as conn, self.watchdog.watch(conn, self.bounds.statement_timeout_s + GRACE_S) as watch:
                yield conn, watch
        except self._errors as exc:
            if watch is not None and watch.cut:
                raise StoreUnavailable(f"the server did not answer within {watch.bound_s:g} s "
                                       "(timeslice.batch.postgresql.statement_timeout_s)") from exc
            text = redact(str(exc).strip())
            raise StoreUnavailable(text.splitlines()[0] if text else type(exc).__name__) from exc

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Tx]:
        with self._call() as (conn, watch), conn.transaction():
            yield _Tx(conn, watch)

    def query(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with self._call() as (conn, _):
            return conn.execute(_pg(sql), args).fetchall()

    def listen(self, wake: Callable[[], None]) -> Listener:
        """``wake`` called (from a thread of its own) whenever lines become claimable (:mod:`~timeslice_verl.batch.pgnotify`)."""
        import psycopg

        connect = lambda: psycopg.connect(self._dsn, autocommit=True, **connect_options(self.bounds))  # noqa: E731
        return Listener(connect, wake, self.where)

    def close(self) -> None:
        self.pool.close()
        self.watchdog.close()


def open_postgresql(dsn_file: str, bounds: PostgresBounds | None = None) -> PostgresEngine:
    dsn, _ = read_dsn(dsn_file)
    return PostgresEngine(dsn, bounds=bounds)


__all__ = ["DSN_ENV", "PostgresEngine", "StoreUnavailable", "open_postgresql", "read_dsn", "shown"]
