"""The batch store's schema, on SQLite and on a real PostgreSQL server: a new database gets it, the first release's is
brought to it in place (its lines kept), a database a development version made (before the first release) is refused
with what to do and left as it was, one from a newer release is refused too."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from pg_support import ENGINES, Postgres, fresh_database, server  # noqa: F401 (server: a fixture)
from timeslice_verl.batch.engine import StoreError
from timeslice_verl.batch.schema import FIRST_RELEASE, SCHEMA_VERSION, for_postgresql, statements
from timeslice_verl.batch.store import Store

DEVELOPMENT_FILES = """CREATE TABLE files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
  bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL)"""
"""The files table as development versions made it (the content in the row)."""
DEVELOPMENT_VERSION = 5


class Database:
    """One database of either engine, reached without the store (to make and read it as another version would)."""

    def __init__(self, engine: str, request: pytest.FixtureRequest, tmp_path) -> None:
        self.engine, self.path, self.dsn = engine, tmp_path / "batch.sqlite", ""
        if engine == "postgresql":
            server: Postgres = request.getfixturevalue("server")
            self.dsn = fresh_database(server, "schema")

    def execute(self, *sql: str) -> list[tuple]:
        if self.engine == "sqlite":
            db = sqlite3.connect(self.path)
            try:
                rows = [db.execute(s).fetchall() for s in sql]
                db.commit()
            finally:
                db.close()
            return rows[-1]
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = [conn.execute(for_postgresql(s)) for s in sql]
            return rows[-1].fetchall() if rows[-1].description else []

    def mark(self, version: int) -> str:
        if self.engine == "sqlite":
            return f"PRAGMA user_version={version}"
        return f"INSERT INTO timeslice_schema (version) VALUES ({version})"

    def version(self) -> int:
        if self.engine == "sqlite":
            return self.execute("PRAGMA user_version")[0][0]
        return self.execute("SELECT version FROM timeslice_schema")[0][0]

    def store(self) -> Store:
        if self.engine == "sqlite":
            return Store(self.path)
        from timeslice_verl.batch.pg import PostgresEngine

        return Store(PostgresEngine(self.dsn))

    def make_development(self, version: int) -> None:
        marker = [] if self.engine == "sqlite" else ["CREATE TABLE timeslice_schema (version INTEGER NOT NULL)"]
        self.execute(DEVELOPMENT_FILES, *marker, "INSERT INTO files VALUES ('file_old', 'batch', 'old.jsonl', 3, 1, "
                     + ("X'616263'" if self.engine == "sqlite" else "convert_to('abc', 'UTF8')") + ")", self.mark(version))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_new_database_gets_the_one_schema_and_opens_again(request, tmp_path, engine):
    db = Database(engine, request, tmp_path)
    db.store().close()
    assert db.version() == SCHEMA_VERSION
    store = db.store()  # the second start finds the schema and keeps it
    try:
        assert store.files() == [] and db.version() == SCHEMA_VERSION
    finally:
        store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_development_database_is_refused_with_what_to_do_and_left_as_it_was(request, tmp_path, engine):
    db = Database(engine, request, tmp_path)
    db.make_development(DEVELOPMENT_VERSION)
    with pytest.raises(StoreError) as refused:
        db.store()
    said = str(refused.value)
    assert f"development version of timeslice-verl (schema {DEVELOPMENT_VERSION}" in said
    assert f"reads schema {SCHEMA_VERSION} and its first release's only" in said and "timeslice-verl batch results" in said
    remedy = "move" if engine == "sqlite" else "TIMESLICE_BATCH_DSN a new database"
    assert remedy in said and "a new one is created at start" in said
    assert db.version() == DEVELOPMENT_VERSION  # nothing lost: its file is there, untouched
    assert db.execute("SELECT id, bytes FROM files") == [("file_old", 3)]


V9_BATCHES = (",\n  prompt_tokens INTEGER NOT NULL DEFAULT 0, gpu_s REAL NOT NULL DEFAULT 0, cuts INTEGER NOT NULL "
              "DEFAULT 0,\n  first_sent_at REAL, wait_s REAL NOT NULL DEFAULT 0, sent_lines INTEGER NOT NULL DEFAULT 0")
V10_BATCHES = ",\n  asked_tokens INTEGER NOT NULL DEFAULT 0, asked_lines INTEGER NOT NULL DEFAULT 0"


def older(version: int) -> list[str]:
    """The schema's statements as ``version`` (7: the first release, 8, 9) made them: 10 added what a batch's lines
    ask for, 9 the attribution's columns and ``gpu_usage``, 8 ``lines.partial``."""
    out = [s.replace(V10_BATCHES, "") for s in statements()]
    assert all("asked" not in s for s in out)
    if version >= 9:
        return out
    out = [s.replace(V9_BATCHES, "").replace("  sends INTEGER NOT NULL DEFAULT 0,\n", "") for s in out
           if "gpu_usage" not in s]
    assert all("gpu_s" not in s and "sends" not in s for s in out)
    return [s.replace("  partial TEXT,\n", "") for s in out] if version < 8 else out


def _older_with_a_batch(db: Any, engine: str, version: int, owner: str | None = None, body: str = "{}") -> Any:
    """``db`` made by schema ``version``, holding one in-progress batch of one queued line (``owner``'s where given)."""
    marker = [] if engine == "sqlite" else ["CREATE TABLE timeslice_schema (version INTEGER NOT NULL)"]
    column, value = ("", "") if owner is None else (", owner", f", '{owner}'")
    db.execute(*older(version), *marker,
               "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at, "
               f"total, queued{column}) VALUES ('batch_1', '/v1/completions', 'f', '24h', 'in_progress', 1, 4000000000, "
               f"1, 1{value})",
               f"INSERT INTO lines (batch_id, idx, custom_id, body, state) VALUES ('batch_1', 0, 'a', '{body}', 'queued')",
               db.mark(version))
    return db


@pytest.mark.parametrize("version", [FIRST_RELEASE, 8])
@pytest.mark.parametrize("engine", ENGINES)
def test_an_older_releases_database_gains_the_attribution_in_place(request, tmp_path, engine, version):
    """Schemas 7 and 8 had no attribution: the database gains its columns and table in one step, its batch's line is
    claimed and answered as before and its tokens in, GPU-seconds and wait counted from there."""
    from timeslice_verl.batch.claims import Outcome

    db = _older_with_a_batch(Database(engine, request, tmp_path), engine, version, owner="team-a")
    store = db.store()
    try:
        assert db.version() == SCHEMA_VERSION
        (line,) = store.claim(5)
        assert line.owner == "team-a"
        answer = Outcome(line, "done", response="{}", tokens=3, prompt_tokens=7)
        assert store.record([answer], {("batch_1", "team-a"): 1.5}) == 1
        row = store.batch("batch_1")
        assert (row["prompt_tokens"], row["tokens"], row["gpu_s"], row["sent_lines"]) == (7, 3, 1.5, 1)
        assert row["first_sent_at"] > 1 and row["wait_s"] > 0
        assert store.queue.quotas.gpu_day("team-a") == 1.5
    finally:
        store.close()
    db.store().close()  # opened again: nothing more to do
    assert db.version() == SCHEMA_VERSION


@pytest.mark.parametrize("version", [FIRST_RELEASE, 8, 9])
@pytest.mark.parametrize("engine", ENGINES)
def test_an_older_releases_database_gains_what_lines_ask_for_in_place(request, tmp_path, engine, version):
    """Schemas 7 to 9 kept no tokens asked: a batch made before reads as one whose lines name no limit (its ETA rests
    on the measured tokens per line, as it did), a batch made after keeps what its lines ask for, and the meter's
    counters read both."""
    from timeslice_verl.batch.claims import Outcome
    from timeslice_verl.batch.eta import Rate, Work, asked_per_line, per_line
    from timeslice_verl.batch.lines import RequestLine

    db = _older_with_a_batch(Database(engine, request, tmp_path), engine, version, body='{"max_tokens": 64}')
    store = db.store()
    try:
        assert db.version() == SCHEMA_VERSION
        old = store.batch("batch_1")
        assert (old["asked_tokens"], old["asked_lines"]) == (0, 0)
        assert asked_per_line(old["asked_tokens"], old["asked_lines"]) is None
        rate = Rate(100.0, 5.0, 0.5, 20.0, 300.0, fill=0.5)
        assert per_line(Work("batch_1", 0, "", 1, 4e9, 1), rate) == 20.0  # the measured mean, as before
        lines = [RequestLine(1, "x", "{}", 64), RequestLine(2, "y", "{}", 32), RequestLine(3, "z", "{}")]
        new = store.create_batch("/v1/completions", "f", 3600, "1h", None, lines)
        row = store.batch(new)
        assert (row["asked_tokens"], row["asked_lines"]) == (96, 2)
        assert per_line(Work(new, 0, "", 2, 4e9, 3, asked=asked_per_line(96, 2)), rate) == 24.0  # 48 asked, half
        for line in store.claim(5):
            store.record([Outcome(line, "done", response="{}", tokens=40 if line.batch_id == new else 9)])
        assert store.counters() == {"backlog": 0.0, "done": 4.0, "tokens": 129.0, "asked": 144.0, "asked_out": 120.0}
    finally:
        store.close()
    db.store().close()  # opened again: nothing more to do
    assert db.version() == SCHEMA_VERSION


@pytest.mark.parametrize("engine", ENGINES)
def test_the_first_releases_database_is_brought_up_in_place_its_lines_kept(request, tmp_path, engine):
    """Schema 7 had no ``lines.partial`` (the output a yield cut): its database gains the column, its queued line is
    claimed as it was and can keep a cut's output."""
    from timeslice_verl.batch.claims import Outcome

    db = Database(engine, request, tmp_path)
    first = older(FIRST_RELEASE)
    assert all("partial" not in s for s in first)
    marker = [] if engine == "sqlite" else ["CREATE TABLE timeslice_schema (version INTEGER NOT NULL)"]
    db.execute(*first, *marker, "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
               "expires_at, total, queued) VALUES ('batch_1', '/v1/completions', 'f', '24h', 'in_progress', 1, "
               "4000000000, 1, 1)", "INSERT INTO lines (batch_id, idx, custom_id, body, state) VALUES ('batch_1', 0, "
               "'a', '{}', 'queued')", db.mark(FIRST_RELEASE))
    store = db.store()
    try:
        assert db.version() == SCHEMA_VERSION
        (line,) = store.claim(5)
        assert (line.custom_id, line.partial) == ("a", None)
        assert store.record([Outcome(line, "queued", partial='{"kept": 1}')]) == 1
        assert [r["partial"] for r in store.query("SELECT partial FROM lines")] == ['{"kept": 1}']
    finally:
        store.close()
    db.store().close()  # opened again: nothing more to do
    assert db.version() == SCHEMA_VERSION


@pytest.mark.parametrize("engine", ENGINES)
def test_a_newer_releases_database_is_refused(request, tmp_path, engine):
    db = Database(engine, request, tmp_path)
    db.make_development(SCHEMA_VERSION + 1)
    with pytest.raises(StoreError, match=f"has schema {SCHEMA_VERSION + 1}; this version reads {SCHEMA_VERSION}"):
        db.store()
    assert db.version() == SCHEMA_VERSION + 1


def test_the_schema_speaks_postgresqls_type_names():
    assert all("BLOB" not in for_postgresql(s) and " REAL" not in for_postgresql(s) for s in statements())
    assert for_postgresql("bytes INTEGER NOT NULL, seq INTEGER") == "bytes BIGINT NOT NULL, seq BIGINT"
