"""The batch package's SQL catalogue: the loader reads named statements and refuses what it cannot read with where
and why."""

from __future__ import annotations

import pytest

from timeslice_verl.batch.sql import CatalogueError, merge, parse, render

GOOD = [
    ("-- name: one\nSELECT 1;\n", {"one": {None: "SELECT 1"}}),
    ("-- a file's comment\n\n--name:one\nSELECT 1\n-- a comment in it\nFROM t;\n-- name: two\nSELECT 2",
     {"one": {None: "SELECT 1\nFROM t"}, "two": {None: "SELECT 2"}}),
    ("-- name: lock.sqlite\nSELECT 1;\n-- name: lock.postgresql\nSELECT 1 FOR UPDATE;",
     {"lock": {"sqlite": "SELECT 1", "postgresql": "SELECT 1 FOR UPDATE"}}),
    ("-- name: pg_only.postgresql\nSELECT 1", {"pg_only": {"postgresql": "SELECT 1"}}),
    ("", {}),
]


@pytest.mark.parametrize(("text", "entries"), GOOD)
def test_the_loader_reads_named_statements(text, entries):
    assert parse(text, "q.sql") == entries


BAD = [
    ("-- name:\nSELECT 1", "q.sql:1: a '-- name:' header without a name"),
    ("-- name: one\nSELECT 1\n-- name: one\nSELECT 2", "q.sql:3: 'one' is named twice (first at line 1)"),
    ("SELECT 1\n-- name: one\nSELECT 2", "q.sql:1: SQL before the first '-- name:' header"),
    ("-- name: one\n-- only a comment\n-- name: two\nSELECT 2", "q.sql:1: statement 'one' has no SQL"),
    ("-- name: One\nSELECT 1", "q.sql:1: 'One' is not a statement's name"),
    ("-- name: one two\nSELECT 1", "q.sql:1: 'one two' is not a statement's name"),
    ("-- name: one.mysql\nSELECT 1", "q.sql:1: 'one.mysql' names the engine 'mysql'"),
    ("-- name: one\nSELECT 1\n-- name: one.sqlite\nSELECT 2", "q.sql:3: 'one.sqlite': a name has one text for both"),
    ("-- name: one.sqlite\nSELECT 1\n-- name: one.sqlite\nSELECT 2", "q.sql:3: 'one.sqlite' is named twice"),
]


@pytest.mark.parametrize(("text", "error"), BAD)
def test_the_loader_refuses_what_it_cannot_read_saying_where(text, error):
    with pytest.raises(CatalogueError) as caught:
        parse(text, "q.sql")
    assert str(caught.value).startswith(error)


def test_a_name_in_two_files_and_an_unknown_slot_are_refused():
    with pytest.raises(CatalogueError, match="'one' is named in a.sql too"):
        merge(("a.sql", parse("-- name: one\nSELECT 1")), ("b.sql", parse("-- name: one\nSELECT 2")))
    with pytest.raises(CatalogueError, match=r"statement 'one': unknown slot \{when\} \(known: now\)"):
        render(parse("-- name: one\nSELECT {when}"), "sqlite", {"now": "0"})
    assert render(parse("-- name: one\nSELECT {now}\n-- name: two.postgresql\nSELECT 2"), "sqlite", {"now": "7"}) == \
        {"one": "SELECT 7"}
