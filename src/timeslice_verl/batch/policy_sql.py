"""The SQL of keys' policies (quotas), in one place: the statements both engines speak, ``{now}`` standing for the
database's own clock (:attr:`~timeslice_verl.batch.engine.Dialect.now`), so a sliding window is the server's,
never a node's.

A window's tokens are summed over the answers' lines (``lines.tokens``: the usage the answer reported, its
``completion_tokens``; ``lines.done_at``: when it was recorded, by the database's clock) of the owner's batches that
were open during the window — an ended batch's lines are read only while its end is within the window (and an hour
of slack for the nodes' clocks, which wrote ``completed_at``), so the cost follows the owner's recent work, not its
history.
"""

from __future__ import annotations

from timeslice_verl.batch.engine import Dialect

_RECENT = ("l.state = 'done' AND l.done_at >= {now} - ? AND l.batch_id IN (SELECT id FROM batches WHERE owner = ? "
           "AND COALESCE(completed_at, cancelled_at, expired_at, failed_at, {now}) >= {now} - ?)")

STATEMENTS: dict[str, str] = {
    # (hour, window, owner, window + slack) -> the owner's tokens over the last hour and over the window (a day)
    "owner_usage": "SELECT COALESCE(SUM(CASE WHEN l.done_at >= {now} - ? THEN l.tokens ELSE 0 END), 0) AS hour, "
                   "COALESCE(SUM(l.tokens), 0) AS window FROM lines l WHERE " + _RECENT,
    # (window, window, owner, window + slack) -> each answer's tokens and the seconds until it leaves the window,
    # oldest first
    "owner_frees": "SELECT l.done_at + ? - {now} AS frees_in, l.tokens AS tokens FROM lines l WHERE " + _RECENT +
                   " ORDER BY l.done_at",
}
"""Named statements; :func:`sql` gives one for an engine."""

CLOCK_SLACK_S = 3600
"""How much the nodes' clocks (a batch's end) may lag the database's before an ended batch's lines are missed."""


def sql(name: str, dialect: Dialect) -> str:
    """Statement ``name`` in ``dialect`` (its clock)."""
    return STATEMENTS[name].replace("{now}", dialect.now)


__all__ = ["CLOCK_SLACK_S", "STATEMENTS", "sql"]
