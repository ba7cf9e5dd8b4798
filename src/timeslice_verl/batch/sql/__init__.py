"""The batch package's SQL, every statement in one catalogue of named queries (``queries.sql``; ``setup.sql``: a
connection's settings, the schema's version and its upgrades in place; the tables in ``schema.sql``), loaded once and
referenced by name: what the queue asks of its database is read in one place, and no module builds a statement out
of strings.

A statement starts at its header, ``-- name: claim_lines``, and runs to the next one. Where the two engines need
different text, the name carries the engine (``-- name: lock_batch.postgresql``); a name has either one text for both
or a text per engine, never both. ``{slot}`` stands for a fragment that differs by engine (the database's clock, a
row lock, ...): :func:`render` fills it in from the engine's :class:`~timeslice_verl.batch.engine.Dialect`, and refuses
a slot it was not given. Parameters are ``?`` (PostgreSQL's engine translates them).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Mapping

DIALECTS = ("sqlite", "postgresql")
FILES = ("schema.sql", "setup.sql", "queries.sql")
"""The catalogue's files, in the order they are read (the schema's statements are created in their file's order)."""
_HEADER = re.compile(r"^--\s*name:(.*)$")
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_SLOT = re.compile(r"\{([^{}]*)\}")

Entries = dict[str, dict[str | None, str]]
"""name → engine (None: both) → text."""


class CatalogueError(ValueError):
    """The catalogue cannot be read: a header without a name, a name twice, SQL outside a named statement, ..."""


def parse(text: str, source: str = "queries.sql") -> Entries:
    """The named statements of ``text``, in their order; comment lines and a final ``;`` left out."""
    entries: Entries = {}
    where: dict[tuple[str, str | None], int] = {}
    current: tuple[str, str | None] | None = None
    body: list[str] = []

    def close() -> None:
        if current is None:
            return
        sql = "\n".join(body).strip().rstrip(";").rstrip()
        if not sql:
            raise CatalogueError(f"{source}:{where[current]}: statement {_shown(current)!r} has no SQL")
        entries.setdefault(current[0], {})[current[1]] = sql

    for no, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line.strip())
        if header:
            close()
            current, body = _key(header.group(1).strip(), source, no), []
            _add(current, no, where, source)
        elif line.strip().startswith("--") or not line.strip():
            continue
        elif current is None:
            raise CatalogueError(f"{source}:{no}: SQL before the first '-- name:' header")
        else:
            body.append(line.rstrip())
    close()
    return entries


def _key(name: str, source: str, no: int) -> tuple[str, str | None]:
    if not name:
        raise CatalogueError(f"{source}:{no}: a '-- name:' header without a name")
    base, _, dialect = name.partition(".")
    if not _NAME.fullmatch(base):
        raise CatalogueError(f"{source}:{no}: {name!r} is not a statement's name (lower case letters, digits and _, "
                             "starting with a letter)")
    if dialect and dialect not in DIALECTS:
        raise CatalogueError(f"{source}:{no}: {name!r} names the engine {dialect!r}; known: {', '.join(DIALECTS)}")
    return base, dialect or None


def _add(key: tuple[str, str | None], no: int, where: dict[tuple[str, str | None], int], source: str) -> None:
    if key in where:
        raise CatalogueError(f"{source}:{no}: {_shown(key)!r} is named twice (first at line {where[key]})")
    other = [k for k in where if k[0] == key[0] and (k[1] is None) != (key[1] is None)]
    if other:
        raise CatalogueError(f"{source}:{no}: {_shown(key)!r}: a name has one text for both engines or one per engine, "
                             f"not both ({_shown(other[0])!r} at line {where[other[0]]})")
    where[key] = no


def _shown(key: tuple[str, str | None]) -> str:
    return key[0] + (f".{key[1]}" if key[1] else "")


def merge(*parts: tuple[str, Entries]) -> Entries:
    """Several files' statements as one catalogue (``(source, entries)`` each); a name in two files is refused."""
    out: Entries = {}
    seen: dict[str, str] = {}
    for source, entries in parts:
        for name, texts in entries.items():
            if name in seen:
                raise CatalogueError(f"{source}: {name!r} is named in {seen[name]} too")
            seen[name], out[name] = source, texts
    return out


def render(entries: Entries, dialect: str, slots: Mapping[str, str]) -> dict[str, str]:
    """Each statement's text for ``dialect`` (one without a text for it is left out), its ``{slot}`` filled in."""
    out: dict[str, str] = {}
    for name, texts in entries.items():
        text = texts.get(dialect, texts.get(None))
        if text is not None:
            out[name] = _fill(name, text, slots)
    return out


def _fill(name: str, text: str, slots: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in slots:
            raise CatalogueError(f"statement {name!r}: unknown slot {{{m.group(1)}}} (known: {', '.join(sorted(slots))})")
        return slots[m.group(1)]

    return _SLOT.sub(one, text)


@functools.cache
def catalogue() -> Entries:
    """The package's catalogue, read once."""
    here = resources.files(__name__)
    return merge(*((f, parse(here.joinpath(f).read_text(encoding="utf-8"), f)) for f in FILES))


@functools.cache
def schema_names() -> tuple[str, ...]:
    """The schema's statements, in the order they are created."""
    return tuple(parse(resources.files(__name__).joinpath("schema.sql").read_text(encoding="utf-8"), "schema.sql"))


__all__ = ["DIALECTS", "CatalogueError", "Entries", "catalogue", "merge", "parse", "render", "schema_names"]
