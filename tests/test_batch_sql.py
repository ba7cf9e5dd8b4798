"""The batch package's SQL catalogue: the loader reads named statements and refuses what it cannot read with where
and why; every statement renders for both engines, every name the code asks for is there (and every statement is
asked for); and no module of the batch package outside the loader holds a statement of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from timeslice_verl.batch.engine import POSTGRESQL, SQLITE
from timeslice_verl.batch.sql import CatalogueError, catalogue, merge, parse, render, schema_names

BATCH = Path(__file__).resolve().parents[1] / "src" / "timeslice_verl" / "batch"

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


def test_every_statement_renders_for_both_engines_and_the_schema_keeps_its_order():
    for dialect in (SQLITE, POSTGRESQL):
        for name in catalogue():
            if dialect.name in catalogue()[name] or None in catalogue()[name]:
                assert "{" not in dialect.sql(name), name
    assert schema_names()[:2] == ("create_files", "create_file_chunks")
    with pytest.raises(KeyError, match="no statement 'nothing' for sqlite"):
        SQLITE.sql("nothing")


def _strings(path: Path) -> list[tuple[int, str]]:
    """The string literals of a module but its docstrings, its attributes' included (f-strings' parts included)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


STATEMENT = re.compile(r"SELECT |INSERT INTO|UPDATE .* SET|DELETE FROM|CREATE (TABLE|INDEX)|PRAGMA |BEGIN|COMMIT|ROLLBACK")


def test_no_module_of_the_batch_package_holds_a_statement_of_its_own():
    found = [f"{p.name}:{line}: {text[:60]!r}" for p in sorted(BATCH.glob("*.py")) for line, text in _strings(p)
             if STATEMENT.search(text)]
    assert found == [], "SQL belongs in the catalogue, src/timeslice_verl/batch/sql/"


def test_every_name_the_code_asks_for_is_in_the_catalogue_and_every_statement_is_asked_for():
    asked = {m for p in BATCH.glob("*.py") for m in re.findall(r"""sql\(\s*"(\w+)"\s*\)""", p.read_text())}
    asked |= {m for p in BATCH.glob("*.py") for m in re.findall(r"""sql\("(\w+)" if \w+ else "(\w+)"\)""",
                                                                 p.read_text()) for m in m}
    names = set(catalogue())
    assert asked - names == set(), "asked for and not in the catalogue"
    assert names - asked - set(schema_names()) == set(), "in the catalogue and never asked for"
