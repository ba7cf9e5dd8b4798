"""The batch store's lines in motion: claimed under a lease, renewed, answered once, put back when their holder is
gone. Kept apart from :mod:`~timeslice_verl.batch.store` (files, batches, their ends); :class:`LineQueue` is the part
the :class:`~timeslice_verl.batch.store.Store` holds for the feeders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping

from timeslice_verl.batch.engine import Engine
from timeslice_verl.batch.quota import Quotas
from timeslice_verl.batch.settle import lock_batches, settle, wake
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
    partial: str | None = None
    """What earlier tries a yield cut generated (:class:`~timeslice_verl.batch.resume.Partial` as JSON): this try
    continues it."""
    owner: str = ""
    """Its batch's owner: the valley GPU-seconds its tries receive are the owner's (:mod:`~timeslice_verl.batch.usage`)."""


@dataclass(frozen=True)
class Outcome:
    """What became of one try of a line: ``done`` (its response), ``queued`` (again, ``delay_s`` later) or ``failed``."""

    line: Line
    state: Literal["done", "queued", "failed"]
    response: str | None = None
    """JSON text: ``{"status_code", "request_id", "body"}``."""
    error: str | None = None
    tokens: int = 0
    delay_s: float = 0.0
    """How long a line queued again waits before a claim takes it, on the database's clock (the next feeder to
    claim it may be another node's)."""
    partial: str | None = None
    """Queued with the output kept so far (JSON), written with its state: the next try continues it, this one is
    not counted."""
    restart: bool = False
    """Queued to start again, the output kept so far dropped (its continued request was refused)."""
    prompt_tokens: int = 0
    """A done answer's ``usage.prompt_tokens`` (the batch's input tokens)."""
    cut: bool = False
    """This try was cut by a yield (the answer's ``finish_reason: abort``), whatever became of the line."""

    @classmethod
    def answer(cls, line: Line, response: str, usage: Mapping[str, Any] | None) -> Outcome:
        """A line answered: ``response`` (JSON text), its tokens from the answer's ``usage``."""
        use = usage if isinstance(usage, Mapping) else {}
        return cls(line, "done", response=response, tokens=int(use.get("completion_tokens") or 0),
                   prompt_tokens=int(use.get("prompt_tokens") or 0))


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
        whose lease ran out on the database's clock (a cluster: the holder, or the creator, is gone)."""
        n, sql, every = 0, self.dialect.sql, int(everything)
        # a creation under way: validating (failed when its creator is gone), or cancelled meanwhile (then cancelled)
        for row in self.query(sql("creations_stopped"), (every,)):
            with self.transaction() as db:
                lock_batches(db, self.dialect, [row["id"]])
                if db.execute(sql("creation_interrupted"), (_INTERRUPTED, row["id"], every)).rowcount:
                    db.execute(sql("lines_delete"), (row["id"],))
        for row in self.query(sql("batches_inflight")):
            with self.transaction() as db:
                lock_batches(db, self.dialect, [row["id"]])
                moved = db.execute(sql("lines_take_back"), (row["id"], row["id"], every)).rowcount
                if moved:
                    db.execute(sql("batch_requeued"), (moved, moved, row["id"]))
                    wake(db, self.dialect)
                n += moved
        return n

    def claim(self, n: int, holder: str = "", lease_s: float = LEASE_S,
              role: TenantRole = TenantRole.batch) -> list[Line]:
        """Up to ``n`` lines ready to send (:func:`~timeslice_verl.batch.share.plan`: priority, owners' share by
        weight, earliest deadline, creation order; input order within a batch; an owner over a quota's passed over) of
        the batches a tenant of ``role`` answers, marked in flight for ``holder`` for ``lease_s`` of the database's
        time (one more try each, a new fencing token). Lines another feeder holds are passed over, and so, at first,
        is a batch whose row another transaction holds: a feeder frozen inside its transaction stops no other's claims
        (a claim that found nothing else waits for that row, until the server ends the frozen transaction:
        ``timeslice.batch.postgresql.idle_in_transaction_s``)."""
        if n <= 0:
            return []
        rows = self.query(self.dialect.sql("claim_candidates"), (role.value,))
        endpoint, owner = {r["id"]: r["endpoint"] for r in rows}, {r["id"]: r["owner"] for r in rows}
        paused = self.quotas.paused(r["owner"] for r in rows)
        planned = plan([Waiting(r["id"], r["priority"], r["owner"], r["seq"], r["queued"], r["inflight"],
                                self.quotas.weight(r["owner"]), float(r["expires_at"]))
                        for r in rows if r["owner"] not in paused], n)
        got, passed = self._take(planned, holder, lease_s, wait=False)
        if not got and passed:
            got, _ = self._take(passed, holder, lease_s, wait=True)
        return [Line(bid, r["idx"], r["custom_id"], r["body"], r["attempts"], endpoint[bid], r["token"], r["partial"],
                     owner[bid]) for bid, _ in planned for r in got.get(bid, [])]

    def _take(self, planned: list[tuple[str, int]], holder: str, lease_s: float,
              wait: bool) -> tuple[dict[str, list[Any]], list[tuple[str, int]]]:
        """One claim's transaction: the planned batches' rows locked first, in id order (``wait``: else those another
        transaction holds are passed over), then each batch's lines taken in one statement that locks only the rows
        it takes; the lines taken by batch (as they are now: in flight), and the batches passed over."""
        taken: dict[str, list[Any]] = {}
        if not planned:
            return taken, []
        want, sql = dict(planned), self.dialect.sql
        with self.transaction() as db:
            ids = json.dumps(sorted(want))
            held = {r["id"] for r in db.execute(sql("claim_batches_wait" if wait else "claim_batches"), (ids,)).fetchall()}
            for bid in sorted(held):
                got = sorted(db.execute(sql("claim_lines"), (bid, want[bid], holder, lease_s, bid)).fetchall(),
                             key=lambda r: r["idx"])
                if not got:
                    continue
                again, first = sum(1 for r in got if r["attempts"] > 1), sum(1 for r in got if r["sends"] == 1)
                db.execute(sql("batch_taken"), (len(got), len(got), again, first, first, bid))
                taken[bid] = got
        return taken, [(bid, k) for bid, k in planned if bid not in held]

    def renew(self, holder: str, lease_s: float = LEASE_S) -> set[tuple[str, int, int]]:
        """Extend by ``lease_s`` (the database's time) the lease of every line ``holder`` has in flight (its feeder
        lives); the lines it still holds, as ``(batch_id, idx, token)``: one missing was taken back while the
        feeder was away (a pause past its lease), and is no longer its to send. Rows locked in id order, as every
        transaction locks lines."""
        with self.transaction() as db:
            rows = db.execute(self.dialect.sql("lines_renew"), (lease_s, holder, holder)).fetchall()
        return {(r["batch_id"], r["idx"], r["token"]) for r in rows}

    def release(self, lines: list[Line]) -> int:
        """Lines claimed and never sent go back to the queue, their try not counted."""
        moved: dict[str, int] = {}
        sql = self.dialect.sql
        with self.transaction() as db:
            lock_batches(db, self.dialect, [ln.batch_id for ln in lines])
            for ln in sorted(lines, key=lambda x: (x.batch_id, x.idx)):  # lines too in id order
                if db.execute(sql("line_release"), (ln.batch_id, ln.idx, ln.token)).rowcount:
                    moved[ln.batch_id] = moved.get(ln.batch_id, 0) + 1
            for bid, k in moved.items():
                again = sum(1 for ln in lines if ln.batch_id == bid and ln.attempts > 1)
                db.execute(sql("batch_released"), (k, k, again, bid))
                settle(db, self.dialect, bid)
            if moved:
                wake(db, self.dialect)
        return sum(moved.values())

    def record(self, outcomes: list[Outcome], spent: Mapping[tuple[str, str], float] | None = None) -> int:
        """Write many lines' outcomes in one transaction; how many took effect. A line no longer in flight under the
        token it was sent with — answered already, put back after its lease ran out and claimed again, or its batch
        cancelled meanwhile — is left as it is: its answer is discarded. ``spent``: the valley GPU-seconds lines of
        each ``(batch, owner)`` received meanwhile (:mod:`~timeslice_verl.batch.usage`), added whatever became of
        their answers (the GPU worked for them)."""
        moved: dict[str, dict[str, int]] = {}
        sql, spent = self.dialect.sql, spent or {}
        with self.transaction() as db:
            lock_batches(db, self.dialect, [o.line.batch_id for o in outcomes] + [bid for bid, _ in spent])
            for o in sorted(outcomes, key=lambda x: (x.line.batch_id, x.line.idx)):  # lines too in id order
                ln, held = o.line, (o.line.batch_id, o.line.idx, o.line.token)
                if o.state == "done":
                    cur = db.execute(sql("line_done"), (o.response, o.tokens, *held))
                elif o.partial is not None:
                    cur = db.execute(sql("line_cut"), (o.delay_s, o.partial, *held))
                elif o.restart:
                    cur = db.execute(sql("line_restart"), (o.delay_s, *held))
                elif o.state == "queued":
                    cur = db.execute(sql("line_again"), (o.delay_s, *held))
                else:
                    cur = db.execute(sql("line_failed"), (o.error, o.response, *held))
                if cur.rowcount:
                    c = moved.setdefault(ln.batch_id, dict.fromkeys(("queued", "done", "failed", "n", "tokens", "in",
                                                                     "cuts"), 0))
                    c[o.state] += 1
                    c["n"] += 1
                    c["tokens"] += o.tokens if o.state == "done" else 0
                    c["in"] += o.prompt_tokens if o.state == "done" else 0
                    c["cuts"] += o.cut
            for bid, c in moved.items():
                db.execute(sql("batch_recorded"), (c["n"], c["queued"], c["done"], c["failed"], c["tokens"], c["in"],
                                                   c["cuts"], bid))
                settle(db, self.dialect, bid)
            _spend(db, sql, spent)
        return sum(c["n"] for c in moved.values())

    def done(self, line: Line, response: dict[str, Any], tokens: int) -> None:
        self.record([Outcome(line, "done", response=json.dumps(response), tokens=tokens)])

    def again(self, line: Line, delay_s: float) -> None:
        self.record([Outcome(line, "queued", delay_s=delay_s)])

    def failed(self, line: Line, error: dict[str, Any], response: dict[str, Any] | None = None) -> None:
        self.record([Outcome(line, "failed", error=json.dumps(error), response=json.dumps(response) if response else None)])

    def results(self, bid: str, state: str) -> Iterator[Any]:
        """The ended lines of a batch in input order (``done``: the output file, ``failed``: the error file)."""
        return iter(self.query(self.dialect.sql("results"), (bid, state)))


def _spend(db: Any, sql: Any, spent: Mapping[tuple[str, str], float]) -> None:
    """Add the GPU-seconds to their batches (rows held already, in id order) and to their owners' minutes, in owner
    order: two feeders' transactions meet in one order, never deadlock."""
    owners: dict[str, float] = {}
    for (bid, owner), seconds in sorted(spent.items()):
        if seconds > 0:
            db.execute(sql("batch_gpu"), (seconds, bid))
            owners[owner] = owners.get(owner, 0.0) + seconds
    for owner, seconds in sorted(owners.items()):
        db.execute(sql("gpu_usage_add"), (owner, seconds))


__all__ = ["LEASE_S", "Line", "LineQueue", "Outcome"]
