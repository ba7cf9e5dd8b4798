"""The tests' PostgreSQL server (:mod:`timeslice_verl.testing.postgres`), skipped with the reason without its
binaries."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from timeslice_verl.testing.postgres import Postgres, pg_bin

__all__ = ["ENGINES", "Postgres", "fresh_database", "need_postgres", "open_store", "server"]

ENGINES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]
"""Parameters of a test that runs on both stores; the PostgreSQL one skips, saying why, without the server binaries."""


def need_postgres() -> Path:
    where = pg_bin()
    if where is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): install postgresql (.ci/run does)")
    return where


@pytest.fixture(scope="module")
def server():
    """A PostgreSQL server of the test module's own (import this fixture into the module that uses it)."""
    need_postgres()
    pg = Postgres().start()
    yield pg
    pg.close()


def fresh_database(pg: Postgres, name: str) -> str:
    """The DSN of a new database on ``pg``, named apart from every other test's and every other copy's."""
    return pg.database(f"{name}_{os.getpid()}_{time.monotonic_ns()}")


def open_store(request: Any, tmp_path: Path, name: str) -> Any:
    """A batch store on ``request.param``'s engine: an SQLite file in ``tmp_path`` or a fresh PostgreSQL database."""
    from timeslice_verl.batch.store import Store

    if request.param == "sqlite":
        return Store(tmp_path / "b.sqlite")
    from timeslice_verl.batch.pg import PostgresEngine

    return Store(PostgresEngine(fresh_database(request.getfixturevalue("server"), name)))


def service_app(store: Any, **overrides: Any) -> Any:
    """The batch service's app on ``store`` with no tenant, no feeder and a 1 MiB file limit (the API alone)."""
    from timeslice_verl.batch.app import make_app

    kwargs = dict(models=lambda role: {"m"}, kick=lambda: None, summary=lambda: {}, metrics=lambda: b"",
                  max_file_bytes=1 << 20)
    return make_app(store, **{**kwargs, **overrides})


def store_fixture(name: str) -> Any:
    """A module's ``store`` fixture: one batch store per engine of :data:`ENGINES` (its database named ``name``),
    closed after the test."""

    @pytest.fixture(params=ENGINES)
    def store(request: Any, tmp_path: Path) -> Any:
        s = open_store(request, tmp_path, name)
        yield s
        s.close()

    return store
