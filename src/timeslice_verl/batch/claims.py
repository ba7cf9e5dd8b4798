"""The batch store's lines in motion: claimed under a lease, renewed, answered once, put back when their holder is
gone. Kept apart from :mod:`~timeslice_verl.batch.store` (files, batches, their ends); :class:`LineQueue` is the part
the :class:`~timeslice_verl.batch.store.Store` holds for the feeders.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from timeslice_verl.batch.engine import Engine
from timeslice_verl.batch.quota import Quotas
from timeslice_verl.batch.settle import lock_batches, settle
from timeslice_verl.batch.share import Waiting, plan
from timeslice_verl.names import TenantRole

LEASE_S = 30.0
"""How long a claimed line stays its feeder's without a renewal (a feeder renews every third of it)."""


@dataclass(frozen=True)
class Line:
    batch_id: str
    idx: int
    custom_id: str
    body: str
    """The request's body as JSON text (sent as it was uploaded)."""
    attempts: int
    endpoint: str
    token: int = 0
    """The claim's fencing token: an answer counts only while the line still carries it."""


@dataclass(frozen=True)
class Outcome:
    """What became of one try of a line: ``done`` (its response), ``queued`` (again, from ``next_at``) or ``failed``."""

    line: Line
    state: Literal["done", "queued", "failed"]
    response: str | None = None
    """JSON text: ``{"status_code", "request_id", "body"}``."""
    error: str | None = None
    tokens: int = 0
    next_at: float = 0.0


_INTERRUPTED = json.dumps({"object": "list", "data": [{
    "code": "interrupted", "line": None, "param": "input_file_id",
    "message": "the batch service stopped while it created this batch: create it again"}]})


class LineQueue:
    """Claims, renewals, results and recovery of the lines in one engine's database."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.dialect = engine, engine.dialect
        self.transaction, self.query = engine.transaction, engine.query
        self.quotas = Quotas(engine)
        """Owners' weights and quotas (the service gives it its key ring's policies): a claim shares by weight and
        passes over the batches of owners over a quota."""

    def recover(self, *, everything: bool = True) -> int:
        """Lines in flight back to the queue, creations that will not finish failed, saying so (their lines were never
        sent). ``everything``: all of them (one node's service at its start: nothing else holds any); else only those
        whose lease ran out (a cluster: the holder, or the creator, is gone)."""
        n, now = 0, time.time()
        lease = "" if everything else f" AND lease_until < {self.dialect.now}"
        creating = "" if everything else " AND creating_until < ?"
        late = () if everything else (now,)
        # a creation under way: validating (failed when its creator is gone), or cancelled meanwhile (then cancelled)
        being_created = "status IN ('validating', 'cancelling') AND in_progress_at IS NULL"
        for row in self.query(f"SELECT id FROM batches WHERE {being_created}" + creating + " ORDER BY id", late):
            with self.transaction() as db:
                lock_batches(db, self.dialect, [row["id"]])
                if db.execute("UPDATE batches SET status = CASE status WHEN 'validating' THEN 'failed' ELSE 'cancelled' END, "
                              "failed_at = CASE status WHEN 'validating' THEN ? END, cancelled_at = CASE status WHEN "
                              "'validating' THEN NULL ELSE ? END, errors = ?, total = 0, queued = 0, failed = 0 WHERE id = ? "
                              f"AND {being_created}" + creating,
                              (int(now), int(now), _INTERRUPTED, row["id"], *late)).rowcount:
                    db.execute("DELETE FROM lines WHERE batch_id = ?", (row["id"],))
        for row in self.query("SELECT id FROM batches WHERE inflight > 0 ORDER BY id"):
            with self.transaction() as db:
                lock_batches(db, self.dialect, [row["id"]])
                moved = db.execute("UPDATE lines SET state = 'queued', next_at = 0, holder = NULL WHERE batch_id = ? AND "
                                   "idx IN (SELECT idx FROM lines WHERE batch_id = ? AND state = 'inflight'" + lease +
                                   " ORDER BY idx" + self.dialect.lock + ") AND state = 'inflight'", (row["id"], row["id"])).rowcount
                if moved:
                    db.execute("UPDATE batches SET inflight = inflight - ?, queued = queued + ? WHERE id = ?",
                               (moved, moved, row["id"]))
                n += moved
        return n

    def claim(self, n: int, now: float, holder: str = "", lease_s: float = LEASE_S,
              role: TenantRole = TenantRole.batch) -> list[Line]:
        """Up to ``n`` lines ready to send (:func:`~timeslice_verl.batch.share.plan`: priority, owners' share by
        weight, earliest deadline, creation order; input order within a batch; an owner over a quota's passed over) of the batches a tenant of ``role`` answers, marked in flight for
        ``holder`` for ``lease_s`` of the database's time (one more try each, a new fencing token). Lines another
        feeder holds are passed over, and so, at first, is a batch whose row another transaction holds: a feeder
        frozen inside its transaction stops no other's claims (a claim that found nothing else waits for that row,
        until the server ends the frozen transaction: ``timeslice.batch.postgresql.idle_in_transaction_s``)."""
        if n <= 0:
            return []
        rows = self.query("SELECT id, endpoint, priority, owner, seq, queued, inflight, expires_at FROM batches WHERE "
                          "status = 'in_progress' AND queued > 0 AND tenant_role = ? ORDER BY id", (role.value,))
        endpoint = {r["id"]: r["endpoint"] for r in rows}
        paused = self.quotas.paused(r["owner"] for r in rows)
        planned = plan([Waiting(r["id"], r["priority"], r["owner"], r["seq"], r["queued"], r["inflight"],
                                self.quotas.weight(r["owner"]), float(r["expires_at"]))
                        for r in rows if r["owner"] not in paused], n)
        got, passed = self._take(planned, now, holder, lease_s, wait=False)
        if not got and passed:
            got, _ = self._take(passed, now, holder, lease_s, wait=True)
        return [Line(bid, r["idx"], r["custom_id"], r["body"], r["attempts"] + 1, endpoint[bid], r["token"] + 1)
                for bid, _ in planned for r in got.get(bid, [])]

    def _take(self, planned: list[tuple[str, int]], now: float, holder: str, lease_s: float,
              wait: bool) -> tuple[dict[str, list[Any]], list[tuple[str, int]]]:
        """One claim's transaction: the planned batches' rows locked first, in id order (``wait``: else those another
        transaction holds are passed over), then their lines; the lines taken by batch, and the batches passed over."""
        taken: dict[str, list[Any]] = {}
        if not planned:
            return taken, []
        want = dict(planned)
        with self.transaction() as db:
            held = {r["id"] for r in db.execute(
                f"SELECT id FROM batches WHERE id IN ({', '.join('?' * len(want))}) AND status = 'in_progress' ORDER BY id"
                + (self.dialect.lock if wait else self.dialect.skip_locked), tuple(sorted(want))).fetchall()}
            for bid in sorted(held):
                got = db.execute("SELECT idx, custom_id, body, attempts, token FROM lines WHERE batch_id = ? AND state = "
                                 "'queued' AND next_at <= ? ORDER BY idx LIMIT ?" + self.dialect.skip_locked,
                                 (bid, now, want[bid])).fetchall()
                if not got:
                    continue
                db.executemany(f"UPDATE lines SET state = 'inflight', attempts = attempts + 1, holder = ?, lease_until = "
                               f"{self.dialect.now} + ?, token = token + 1 WHERE batch_id = ? AND idx = ?",
                               [(holder, lease_s, bid, r["idx"]) for r in got])
                again = sum(1 for r in got if r["attempts"])
                db.execute("UPDATE batches SET queued = queued - ?, inflight = inflight + ?, retried = retried + ? "
                           "WHERE id = ?", (len(got), len(got), again, bid))
                taken[bid] = got
        return taken, [(bid, k) for bid, k in planned if bid not in held]

    def renew(self, holder: str, lease_s: float = LEASE_S) -> set[tuple[str, int, int]]:
        """Extend by ``lease_s`` (the database's time) the lease of every line ``holder`` has in flight (its feeder
        lives); the lines it still holds, as ``(batch_id, idx, token)``: one missing was taken back while the
        feeder was away (a pause past its lease), and is no longer its to send. Rows locked in id order, as every
        transaction locks lines."""
        with self.transaction() as db:
            rows = db.execute(f"UPDATE lines SET lease_until = {self.dialect.now} + ? WHERE (batch_id, idx) IN (SELECT "
                              "batch_id, idx FROM lines WHERE holder = ? AND state = 'inflight' ORDER BY batch_id, idx"
                              + self.dialect.lock + ") AND holder = ? AND state = 'inflight' RETURNING batch_id, idx, token",
                              (lease_s, holder, holder)).fetchall()
        return {(r["batch_id"], r["idx"], r["token"]) for r in rows}

    def release(self, lines: list[Line]) -> int:
        """Lines claimed and never sent go back to the queue, their try not counted."""
        moved: dict[str, int] = {}
        with self.transaction() as db:
            lock_batches(db, self.dialect, [ln.batch_id for ln in lines])
            for ln in sorted(lines, key=lambda x: (x.batch_id, x.idx)):  # lines too in id order
                if db.execute("UPDATE lines SET state = 'queued', attempts = attempts - 1, holder = NULL WHERE batch_id = ? "
                              "AND idx = ? AND state = 'inflight' AND token = ?", (ln.batch_id, ln.idx, ln.token)).rowcount:
                    moved[ln.batch_id] = moved.get(ln.batch_id, 0) + 1
            for bid, k in moved.items():
                again = sum(1 for ln in lines if ln.batch_id == bid and ln.attempts > 1)
                db.execute("UPDATE batches SET inflight = inflight - ?, queued = queued + ?, retried = retried - ? "
                           "WHERE id = ?", (k, k, again, bid))
                settle(db, bid, int(time.time()))
        return sum(moved.values())

    def record(self, outcomes: list[Outcome]) -> int:
        """Write many lines' outcomes in one transaction; how many took effect. A line no longer in flight under the
        token it was sent with — answered already, put back after its lease ran out and claimed again, or its batch
        cancelled meanwhile — is left as it is: its answer is discarded."""
        moved: dict[str, dict[str, int]] = {}
        now = time.time()
        with self.transaction() as db:
            lock_batches(db, self.dialect, [o.line.batch_id for o in outcomes])
            for o in sorted(outcomes, key=lambda x: (x.line.batch_id, x.line.idx)):  # lines too in id order
                ln, held = o.line, (o.line.batch_id, o.line.idx, o.line.token)
                if o.state == "done":
                    cur = db.execute("UPDATE lines SET state = 'done', response = ?, tokens = ?, done_at = "
                                     f"{self.dialect.now}, holder = NULL WHERE batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?",
                                     (o.response, o.tokens, *held))
                elif o.state == "queued":
                    cur = db.execute("UPDATE lines SET state = 'queued', next_at = ?, holder = NULL WHERE batch_id = ? AND "
                                     "idx = ? AND state = 'inflight' AND token = ?", (o.next_at, *held))
                else:
                    cur = db.execute("UPDATE lines SET state = 'failed', error = ?, response = ?, holder = NULL WHERE "
                                     "batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?",
                                     (o.error, o.response, *held))
                if cur.rowcount:
                    c = moved.setdefault(ln.batch_id, {"queued": 0, "done": 0, "failed": 0, "n": 0, "tokens": 0})
                    c[o.state] += 1
                    c["n"] += 1
                    c["tokens"] += o.tokens if o.state == "done" else 0
            for bid, c in moved.items():
                db.execute("UPDATE batches SET inflight = inflight - ?, queued = queued + ?, done = done + ?, "
                           "failed = failed + ?, tokens = tokens + ? WHERE id = ?",
                           (c["n"], c["queued"], c["done"], c["failed"], c["tokens"], bid))
                settle(db, bid, int(now))
        return sum(c["n"] for c in moved.values())

    def done(self, line: Line, response: dict[str, Any], tokens: int) -> None:
        self.record([Outcome(line, "done", response=json.dumps(response), tokens=tokens)])

    def again(self, line: Line, delay_s: float) -> None:
        self.record([Outcome(line, "queued", next_at=time.time() + delay_s)])

    def failed(self, line: Line, error: dict[str, Any], response: dict[str, Any] | None = None) -> None:
        self.record([Outcome(line, "failed", error=json.dumps(error), response=json.dumps(response) if response else None)])

    def results(self, bid: str, state: str) -> Iterator[Any]:
        """The ended lines of a batch in input order (``done``: the output file, ``failed``: the error file)."""
        return iter(self.query("SELECT idx, custom_id, response, error FROM lines WHERE batch_id = ? AND state = ? "
                               "ORDER BY idx", (bid, state)))


__all__ = ["LEASE_S", "Line", "LineQueue", "Outcome"]
