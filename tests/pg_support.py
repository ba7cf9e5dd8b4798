"""The tests' PostgreSQL server (:mod:`timeslice_verl.testing.postgres`), skipped with the reason without its
binaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from timeslice_verl.testing.postgres import Postgres, pg_bin

__all__ = ["Postgres", "need_postgres"]


def need_postgres() -> Path:
    where = pg_bin()
    if where is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): install postgresql (.ci/run does)")
    return where
