"""The batch queue on PostgreSQL keeps a DSN's password out of every log and warning, and its transactions lock rows
in one order, so one feeder's renewals, answers and claims never deadlock."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from pg_support import need_postgres, server  # noqa: F401 (server: a fixture)
from timeslice_verl.batch.lines import parse
from timeslice_verl.batch.store import Line, Outcome, Store, StoreUnavailable

CHAT = "/v1/completions"
PASSWORD = "Hunter2Secret"
MALFORMED = [
    f"postgresql://u:{PASSWORD}%zz@localhost/db",  # libpq quotes the token it cannot decode: the password
    f"postgresql://u:{PASSWORD}@[::1/db",  # libpq quotes the whole URI
    f"host=/nonexistent user=u password={PASSWORD} Tail{PASSWORD} dbname=x",  # quotes the piece after a space
]


@pytest.mark.postgresql
@pytest.mark.parametrize("dsn", MALFORMED)
def test_a_malformed_dsn_shows_its_password_in_no_log_error_or_warning(dsn, caplog, recwarn):
    """Was: psycopg_pool's warning for a DSN libpq cannot read quoted the password."""
    from timeslice_verl.batch.engine import StoreError
    from timeslice_verl.batch.pg import PostgresEngine

    need_postgres()
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StoreError) as refused:
        PostgresEngine(dsn)
    said = [str(refused.value), caplog.text, *(r.getMessage() for r in caplog.records),
            *(str(w.message) for w in recwarn)]
    assert any("timeslice-batch" in r.getMessage() for r in caplog.records), "the pool's own warning was logged"
    assert not [s for s in said if PASSWORD in s], said


@pytest.mark.postgresql
def test_the_service_started_with_a_malformed_dsn_prints_no_password(tmp_path):
    """The same through ``timeslice-verl batch serve``: its whole output, warnings shown."""
    need_postgres()
    env = {**os.environ, "TIMESLICE_BATCH_DSN": MALFORMED[0], "TIMESLICE_BATCH_API_KEY": "k" * 32,
           "PYTHONWARNINGS": "always"}
    done = subprocess.run([sys.executable, "-m", "timeslice_verl", "--log-level", "DEBUG", "batch", "serve", "--api-only",
                           "--set", "timeslice.batch.store=postgresql", "--set", f"timeslice.batch.db={tmp_path / 'b'}"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "cannot connect" in out, out[-2000:]
    assert "timeslice-batch" in out, "the pool's warnings were shown"
    assert PASSWORD not in out, out[-2000:]


def _deadlocks(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()[0])


@pytest.mark.postgresql
def test_one_feeders_renewals_answers_and_claims_never_deadlock(server):
    """Was: a renewal locked a feeder's lines in the index's order while its answers' write locked them in the
    answers' order: PostgreSQL found deadlocks and ended one of the two. Three threads of one holder, a bounded
    number of times each: renew, answer a shuffled sample (queued again), claim them back."""
    from timeslice_verl.batch.pg import PostgresEngine

    dsn = server.database(f"order_{os.getpid()}_{time.monotonic_ns()}")
    store = Store(PostgresEngine(dsn))
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
                     for i in range(400))
    store.create_batch(CHAT, "f", 86400, "24h", None, parse(text.encode(), CHAT))
    before = _deadlocks(dsn)
    held: list[Line] = store.claim(400, "a")
    guard = threading.Lock()
    errors: list[str] = []

    def renewing() -> None:
        for _ in range(150):
            store.renew("a", 60)

    def answering() -> None:
        rng = random.Random(7)
        for _ in range(150):
            with guard:
                rng.shuffle(held)
                some, held[:] = held[:200], held[200:]
            store.record([Outcome(ln, "queued") for ln in some])

    def claiming() -> None:
        for _ in range(300):
            got = store.claim(100, "a")
            with guard:
                held.extend(got)

    def guarded(fn) -> None:
        try:
            fn()
        except StoreUnavailable as exc:
            errors.append(f"{fn.__name__}: {exc}")

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in (renewing, answering, claiming)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    store.close()
    assert not [t for t in threads if t.is_alive()]
    assert not errors, errors
    assert _deadlocks(dsn) == before
