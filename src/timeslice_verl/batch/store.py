"""The batch service's state: a schema version, every line's fate in one row, and each batch's counters beside it —
so every call costs the same at line 1 and line 50 000 — in one SQLite file (WAL; one node) or one PostgreSQL
database (a cluster: :mod:`~timeslice_verl.batch.engine`).

A line is ``queued`` (waiting, maybe until ``next_at`` after a failed try), ``inflight`` (sent to the tenant),
``done`` (its response recorded) or ``failed`` (its error recorded; the batch's ``failed`` counter counts the lines
that failed on their own, not those a cancel or the window's end kept from being sent). A line's response or error
is written in the same transaction that ends it and moves its batch's counters, so the output and error files — made
from these rows when downloaded — hold every ``custom_id`` of a batch exactly once, also after a ``kill -9``: lines
found ``inflight`` at start go back to the queue (a request whose answer was lost, or answered but not yet written,
is asked again; only an answer that was recorded counts, and a second answer for a line that is no longer in flight
is dropped).

Across nodes, a line in flight is held under a lease by the feeder that claimed it (``holder``, ``lease_until``),
which that feeder renews while it lives; a lease that runs out (the node gone) puts the line back in the queue, and
each claim raises the line's fencing ``token``, so an answer from a holder whose lease was taken over changes
nothing: every ``custom_id`` is still answered once. One node's service (SQLite) takes back everything in flight at
its start. Claims take the highest priority first, share lines between owners, and keep creation order
(:mod:`~timeslice_verl.batch.share`); every transaction that touches lines locks their batches' rows first, then
the lines, each in id order, so feeders on several nodes never deadlock; a claim passes over a batch whose row
another transaction holds (a feeder frozen inside it holds no other up), and leases are set and read on the
database's clock.

Costs per line are constant: a claim reads the oldest open batch's next lines through the ``(batch_id, state, idx)``
index, results are written many to a transaction (:meth:`Store.record`), and whether a batch has ended is read
off its counters, never counted.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from timeslice_verl.batch.claims import LEASE_S, Line, LineQueue, Outcome
from timeslice_verl.batch.engine import Closable, Engine, SqliteEngine, StoreError, StoreUnavailable, Tx
from timeslice_verl.batch.settle import lock_batches, settle, wake
from timeslice_verl.batch.lines import RequestLine
from timeslice_verl.names import TenantRole
from timeslice_verl.batch.schema import SCHEMA_VERSION
from timeslice_verl.batch.status import ENDED, OPEN

COUNTERS = ("queued", "inflight", "done", "failed")
INSERT_CHUNK = 2048
"""Lines a transaction of a batch's creation inserts (the feeder's writes go between two)."""


CREATING_S = 120.0
"""How long a batch being created stays ``validating`` without its creator writing another chunk."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class Store:
    """The batch queue over one engine (a path: SQLite there): files and batches here, the lines in motion in
    :attr:`queue` (a :class:`~timeslice_verl.batch.claims.LineQueue`), whose calls the store passes on."""

    def __init__(self, where: Path | Engine) -> None:
        self.engine: Engine = SqliteEngine(where) if isinstance(where, Path) else where
        self.dialect, self.path = self.engine.dialect, self.engine.where
        self.engine.migrate()
        self.queue = LineQueue(self.engine)

    @property
    def db(self) -> Any:
        """SQLite's connection (tests and tools that speak to the file itself)."""
        return self.engine.db  # type: ignore[attr-defined]

    def transaction(self) -> contextlib.AbstractContextManager[Tx]:
        return self.engine.transaction()

    def query(self, sql: str, args: tuple = ()) -> list[Any]:
        return self.engine.query(sql, args)

    def listen(self, wake: Callable[[], None]) -> Closable | None:
        return self.engine.listen(wake)

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ lines in motion: the queue's

    def recover(self, *, everything: bool = True) -> int:
        return self.queue.recover(everything=everything)

    def claim(self, n: int, holder: str = "", lease_s: float = LEASE_S,
              role: TenantRole = TenantRole.batch) -> list[Line]:
        return self.queue.claim(n, holder, lease_s, role)

    def renew(self, holder: str, lease_s: float = LEASE_S) -> set[tuple[str, int, int]]:
        return self.queue.renew(holder, lease_s)

    def release(self, lines: list[Line]) -> int:
        return self.queue.release(lines)

    def record(self, outcomes: list[Outcome], spent: Mapping[tuple[str, str], float] | None = None) -> int:
        return self.queue.record(outcomes, spent)

    def done(self, line: Line, response: dict[str, Any], tokens: int) -> None:
        self.queue.done(line, response, tokens)

    def again(self, line: Line, delay_s: float) -> None:
        self.queue.again(line, delay_s)

    def failed(self, line: Line, error: dict[str, Any], response: dict[str, Any] | None = None) -> None:
        self.queue.failed(line, error, response)

    def results(self, bid: str, state: str) -> Iterator[Any]:
        return self.queue.results(bid, state)

    # ------------------------------------------------------------------ files

    def file(self, fid: str) -> dict[str, Any] | None:
        rows = self.query(self.dialect.sql("file_get"), (fid,))
        return dict(rows[0]) if rows else None

    def files(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Every file, or ``owner``'s alone."""
        return [dict(r) for r in self.query(self.dialect.sql("files_list"), (owner, owner))]

    # ------------------------------------------------------------------ batches

    def create_batch(self, endpoint: str, input_file_id: str, window_s: int, window: str, metadata: Any,
                     lines: Iterable[RequestLine], *, owner: str = "", priority: int = 0,
                     role: TenantRole = TenantRole.batch, admit: Callable[[str, int], None] | None = None) -> str:
        """A batch of ``lines`` (:class:`~timeslice_verl.batch.lines.RequestLine`), usable once they all are in.

        ``lines`` may be a generator that checks the file as it reads it: they are inserted as they come, a chunk a
        transaction (memory stays bounded, the feeder's writes go between two), the batch ``validating`` — never
        claimed, its total 0 — under a lease each chunk renews. An exception from ``lines`` (a bad line, a file
        deleted while read) deletes the batch and what was inserted, and is raised: no part of a file is ever a
        batch. The last transaction makes it ``in_progress`` with its total; cancelled meanwhile, it ends
        ``cancelled`` there, with that total, its lines never sent. ``admit(id, total)``, called once every line is
        in and before any can be claimed, may refuse the batch by raising: then nothing of it is left."""
        bid, sql = new_id("batch"), self.dialect.sql
        with self.transaction() as db:
            db.execute(sql("batch_insert"), (bid, endpoint, input_file_id, window, json.dumps(metadata) if metadata else None,
                                             window_s, owner, priority, CREATING_S, role.value))
        total = 0
        try:
            chunk: list[tuple] = []
            asked = [0, 0]  # the chunk's tokens asked for at most, and its lines that name a limit
            for line in lines:
                chunk.append((bid, total, line.custom_id, line.body, "queued", None))
                total += 1
                if line.asked is not None:
                    asked[0] += line.asked
                    asked[1] += 1
                if len(chunk) >= INSERT_CHUNK:
                    self._insert(bid, chunk, asked)
            self._insert(bid, chunk, asked)
            if admit is not None:
                admit(bid, total)
        except BaseException:
            with contextlib.suppress(StoreUnavailable), self.transaction() as db:  # else swept as an expired creation
                db.execute(sql("lines_delete"), (bid,))
                db.execute(sql("batch_delete"), (bid,))
            raise
        with self.transaction() as db:
            lock_batches(db, self.dialect, [bid])
            db.execute(sql("batch_created"), (total, total, bid))
            settle(db, self.dialect, bid, created=True)
            wake(db, self.dialect)
        return bid

    def _insert(self, bid: str, chunk: list[tuple], asked: list[int]) -> None:
        """A chunk of a batch's lines, with what they ask for (``asked``: tokens, lines naming a limit; both reset)."""
        with self.transaction() as db:
            db.executemany(self.dialect.sql("lines_insert"), chunk)
            db.execute(self.dialect.sql("batch_creating"), (CREATING_S, asked[0], asked[1], bid))
        chunk.clear()
        asked[:] = [0, 0]

    def batch(self, bid: str) -> dict[str, Any] | None:
        rows = self.query(self.dialect.sql("batch_get"), (bid,))
        return dict(rows[0]) if rows else None

    def batches(self, limit: int = 20, after: str | None = None, owner: str | None = None) -> list[dict[str, Any]]:
        """Newest first (creation order); ``after``: the ones older than that batch; ``owner``: that owner's alone
        (``after`` then one of them too: another owner's id is as unknown as a missing one)."""
        after = after or None
        args = (owner, owner, after, after, owner, owner, limit)
        return [dict(r) for r in self.query(self.dialect.sql("batches_list"), args)]

    def counts(self, bid: str) -> dict[str, int]:
        rows = self.query(self.dialect.sql("batch_counts"), (bid,))
        r = rows[0] if rows else {"queued": 0, "inflight": 0, "done": 0, "failed": 0}
        return {"queued": r["queued"], "inflight": r["inflight"], "completed": r["done"], "failed": r["failed"]}

    def cancel(self, bid: str) -> bool:
        with self.transaction() as db:
            lock_batches(db, self.dialect, [bid])
            moved = db.execute(self.dialect.sql("batch_cancel"), (bid,)).rowcount
            settle(db, self.dialect, bid)
        return moved > 0

    def settle_open(self) -> None:
        """End what can end without a line moving: batches past their window, cancels with nothing in flight; and
        (several nodes) put back the lines whose lease ran out, fail the creations whose creator stopped."""
        if self.dialect.shared:
            self.recover(everything=False)
        with self.transaction() as db:  # the GPU-seconds' minutes no day's quota reads any more
            db.execute(self.dialect.sql("gpu_usage_prune"))
        for row in self.query(self.dialect.sql("batches_open")):
            with self.transaction() as db:
                lock_batches(db, self.dialect, [row["id"]])
                settle(db, self.dialect, row["id"])

    def figures(self, bid: str) -> dict[str, Any]:
        """One batch's lines by fate: completed, failed by error code, the tries beyond each line's first, tokens."""
        row = self.batch(bid) or {}
        out: dict[str, Any] = {"completed": row.get("done", 0), "failed": {}, "retried": row.get("retried", 0),
                               "tokens": row.get("tokens", 0), "open": row.get("queued", 0) + row.get("inflight", 0)}
        for r in self.query(self.dialect.sql("batch_failed_codes"), (bid,)):
            out["failed"][r["code"] or "unknown"] = r["n"]
        return out

    def totals(self) -> dict[str, int]:
        """Lines by state, over every batch; ``retried``: the tries beyond each line's first; ``tokens`` generated."""
        r = self.query(self.dialect.sql("totals"))[0]
        return {k: int(r[k]) for k in ("queued", "inflight", "done", "failed", "retried", "tokens")}

    def counters(self) -> dict[str, float]:
        """What the ETA's speed is measured from (:class:`~timeslice_verl.batch.eta.Sample`), in one read: lines
        waiting or in flight (``backlog``), ``done``, their ``tokens``; ``asked``: the tokens the answered lines of
        batches that name a limit asked for, ``asked_out``: the tokens those answers generated."""
        r = self.query(self.dialect.sql("meter_counters"))[0]
        return {k: float(r[k]) for k in ("backlog", "done", "tokens", "asked", "asked_out")}


__all__ = ["ENDED", "LEASE_S", "OPEN", "SCHEMA_VERSION", "Line", "Outcome", "Store", "StoreError", "StoreUnavailable",
           "new_id"]
