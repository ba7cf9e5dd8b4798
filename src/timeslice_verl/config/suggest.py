"""The key or value a mistyped override meant, from the schema itself (``did you mean …?``).

Hydra answers a key it does not know with "To append to your config use +…", which sends a typo
(``timeslice.handof.swap``) the wrong way; this module walks the settings dataclasses instead and names
the closest real key, or the closest of an enum's values. Free-form mappings (``plugins.options``) take
new keys with ``+``: there Hydra's advice is the right one and nothing is suggested.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from typing import Any

CUTOFF = 0.6
"""difflib's similarity below which no key is offered (its default)."""


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a hint that does not resolve here: the fields' declared types
        return {f.name: f.type for f in dataclasses.fields(cls)}


def schema_keys(root: type, prefix: str) -> list[str]:
    """Every dotted key of the dataclass ``root`` (sections and leaves), each under ``prefix``."""
    keys: list[str] = []
    for name, hint in _hints(root).items():
        key = f"{prefix}.{name}"
        keys.append(key)
        if dataclasses.is_dataclass(hint):
            keys.extend(schema_keys(hint, key))  # type: ignore[arg-type]
    return keys


def _walk(root: type, parts: list[str]) -> tuple[str, Any]:
    """Follow ``parts`` through the schema: ``("unknown", i)`` at the first part no field has, ``("free", None)``
    inside a mapping of free keys, else ``("known", hint)`` with the leaf's type."""
    cls: Any = root
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            origin = typing.get_origin(cls) or cls
            if origin in (dict, typing.Dict) or cls is Any:
                return "free", None
            return "unknown", i
        hints = _hints(cls)
        if part not in hints:
            return "unknown", i
        cls = hints[part]
    return "known", cls


def suggest_key(root: type, section: str, key: str) -> str | None:
    """The schema key closest to ``key`` (``timeslice.handof.swap`` → ``timeslice.handoff.swap``), or None when
    ``key`` exists, lies in a free-form mapping, or nothing is close."""
    parts = key.lstrip("+~").split(".")
    if not parts or parts[0] != section:
        return None
    state, _ = _walk(root, parts[1:])
    if state != "unknown":
        return None
    keys = {k.partition(".")[2]: k for k in schema_keys(root, section)}  # compared without the section's name
    hint = difflib.get_close_matches(".".join(parts[1:]), list(keys), n=1, cutoff=CUTOFF)
    return keys[hint[0]] if hint else None


def suggest_value(root: type, section: str, key: str, value: str) -> str | None:
    """For a key whose type is an enum, the member value closest to ``value`` (``parkk`` → ``park``)."""
    parts = key.lstrip("+~").split(".")
    if not parts or parts[0] != section:
        return None
    state, hint = _walk(root, parts[1:])
    if state != "known" or not (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return None
    choices = [str(m.value) for m in hint]
    close = difflib.get_close_matches(value, choices, n=1, cutoff=CUTOFF)
    return close[0] if close and close[0] != value else None


__all__ = ["schema_keys", "suggest_key", "suggest_value"]
