"""``timeslice.batch.postgresql``: how long the batch service waits on its PostgreSQL. Every wait has a bound, so a
feeder frozen inside a transaction (a GC pause, SIGSTOP, a cut network), a stopped server or a lost packet never
holds the others up for longer than a few seconds."""

from __future__ import annotations

from dataclasses import dataclass

from timeslice_verl.config.checks import ConfigError, _full_key


@dataclass
class PostgresBounds:
    """Set on every connection of the batch store's pool (``store=postgresql``)."""

    statement_timeout_s: float = 10.0
    """The server ends a statement running longer (``statement_timeout``). A statement the server has not answered
    2 s after it — the server stopped, its network cut without a reset — is given up by the client: its connection
    is cut, the feeder tries again, the API answers 503."""
    lock_timeout_s: float = 8.0
    """A statement waiting longer for a row another transaction holds gives up (``lock_timeout``): tried again. Longer
    than ``idle_in_transaction_s``, so a wait outlasts a frozen holder, whose connection the server ends first."""
    idle_in_transaction_s: float = 5.0
    """The server ends a connection idle this long inside a transaction (``idle_in_transaction_session_timeout``): the
    locks of a frozen feeder are released; once it resumes it reconnects and goes on."""
    connect_timeout_s: float = 5.0
    """A connection not made within this (libpq ``connect_timeout``, whole seconds, at least 2) fails; a pooled
    connection that does not answer its check within this is dropped."""
    pool_timeout_s: float = 5.0
    """How long a call waits for a connection of the pool before the store is reported unavailable (503)."""
    keepalive_s: float = 10.0
    """TCP keepalive (both ends): a peer silent this long is probed, thrice a third of it apart, then dropped; data
    unacknowledged this long drops the connection too (``tcp_user_timeout``)."""


RANGES: dict[str, tuple[float, float, bool]] = {
    f"batch.postgresql.{key}": (0.0, 3600.0, False)
    for key in ("statement_timeout_s", "lock_timeout_s", "idle_in_transaction_s", "connect_timeout_s", "pool_timeout_s",
                "keepalive_s")
}
"""Each bound: more than 0 (a wait without bound is what this section removes), at most an hour."""


def check_bounds(bounds: PostgresBounds) -> None:
    """The bounds' order: a lock wait outlasts a frozen holder's connection, and fits in a statement."""
    if bounds.lock_timeout_s <= bounds.idle_in_transaction_s:
        raise ConfigError(_full_key("batch.postgresql.lock_timeout_s"),
                          f"{bounds.lock_timeout_s} must be more than batch.postgresql.idle_in_transaction_s "
                          f"({bounds.idle_in_transaction_s}): a claim would give up before the server ends a frozen "
                          "holder's transaction")
    if bounds.statement_timeout_s < bounds.lock_timeout_s:
        raise ConfigError(_full_key("batch.postgresql.statement_timeout_s"),
                          f"{bounds.statement_timeout_s} must be at least batch.postgresql.lock_timeout_s "
                          f"({bounds.lock_timeout_s}): a statement waiting for a lock would be ended first")


__all__ = ["PostgresBounds", "RANGES", "check_bounds"]
