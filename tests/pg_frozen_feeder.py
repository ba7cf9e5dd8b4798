"""A feeder's store calls in a process of their own that stops itself (SIGSTOP, as a GC pause or a debugger would
stop it) inside a transaction, right after the statement that marks lines ``inflight`` (``claim``) or ``done``
(``record``), holding what that transaction locked. Once continued, it goes on as a feeder does: a call the store
reports unavailable is made again, its lines are answered, and what it did is printed as JSON.

    python pg_frozen_feeder.py DSN claim|record HOLDER N
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

from timeslice_verl.batch.pg import PostgresEngine
from timeslice_verl.batch.store import Outcome, Store, StoreUnavailable


class Stopping:
    """A transaction that stops the process once, after the statement that contains ``marker``."""

    def __init__(self, tx: Any, marker: str, armed: list[bool]) -> None:
        self.tx, self.marker, self.armed = tx, marker, armed

    def _after(self, sql: str) -> None:
        if self.armed and self.marker in sql:
            self.armed.clear()
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def execute(self, sql: str, args: tuple = ()) -> Any:
        out = self.tx.execute(sql, args)
        self._after(sql)
        return out

    def executemany(self, sql: str, rows: list[tuple]) -> Any:
        out = self.tx.executemany(sql, rows)
        self._after(sql)
        return out


def again(call: Any, *args: Any) -> tuple[Any, int]:
    """``call`` until the store takes it (a feeder's retry); its result, and how many times it was unavailable."""
    failed = 0
    while True:
        try:
            return call(*args), failed
        except StoreUnavailable as exc:
            print(f"unavailable: {exc}", file=sys.stderr, flush=True)
            failed += 1
            time.sleep(0.2)


def main() -> int:
    dsn, where, holder, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    store = Store(PostgresEngine(dsn))
    armed = [True]
    real = store.engine.transaction
    marker = "SET state = 'inflight'" if where == "claim" else "SET state = 'done'"

    @contextlib.contextmanager
    def transaction() -> Any:
        with real() as tx:
            yield Stopping(tx, marker, armed)

    store.queue.transaction = transaction  # type: ignore[method-assign]  # the queue claims and records
    lines, failed = again(store.claim, n, holder)
    recorded, failed_record = again(store.record, [Outcome(ln, "done", response=json.dumps({"by": holder}), tokens=1)
                                                   for ln in lines])
    print(json.dumps({"claimed": [[ln.batch_id, ln.idx] for ln in lines], "recorded": recorded,
                      "unavailable": failed + failed_record}), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
