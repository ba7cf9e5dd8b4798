"""The batch service's keys as typed policies: whose objects a key reaches (its owner), whether it reaches everyone's
(its role), which priorities its batches may ask for, and its owner's share and quotas
(:mod:`~timeslice_verl.batch.policy`) — parsed from ``timeslice.batch.key_file`` (read again when it changes:
:class:`~timeslice_verl.batch.auth.KeyRing`).

A line of the key file::

    KEY [owner=NAME] [role=user|admin] [priorities=LOW..HIGH] [weight=W] [tokens_per_hour=N] [tokens_per_day=N]
        [gpu_seconds_per_day=S] [refuse_late=true|false]

``#`` starts a comment (a whole line, or after the key's fields). A plain line (the key alone, the format before
these fields) keeps working:

* ``owner`` omitted: ``key-`` and a hash of the key, as every batch was recorded before — a plain key still finds
  its batches. Several keys may name one owner (a team's keys share its files, batches and fair share); naming the
  hash a plain key had (``owner=key-…``) keeps that key's earlier batches when it gets fields.
* ``role`` omitted: ``user`` (its owner's files and batches alone) — except a plain line that is the file's first key:
  the key the service made at its first start, which ``timeslice-verl batch …``, ``status`` and the validator send,
  is ``admin`` (every owner's files and batches), as that key could do everything before. ``TIMESLICE_BATCH_API_KEY``
  (one key, given instead of the file) is ``admin`` too.
* ``priorities`` omitted: a ``user`` up to the users' normal priority (``-100..0``; ``0`` is what a batch asks for
  without one), an ``admin`` every priority a batch may have (``-100..100``: validation runs ask for
  ``timeslice.validate.priority``, 100). ``LOW..HIGH`` (either end may be left out: ``..5``), or one number.
* ``weight``, ``tokens_per_hour``, ``tokens_per_day``, ``gpu_seconds_per_day``, ``refuse_late`` omitted: weight 1,
  no quota, a late batch made and flagged. They are the owner's: on several
  lines of one owner, a field must say the same wherever it is given.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass, field, replace
from typing import Iterable

from timeslice_verl.batch.policy import DEFAULT, NAMES, OwnerPolicy, PolicyError, with_field

LOWEST, HIGHEST, NORMAL = -100, 100, 0
"""The priorities a batch may ask for, and the one it has without asking (users' work)."""
_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


class KeyLineError(ValueError):
    """A line of the key file this service cannot read: the message says what is wrong (the caller adds where)."""


class KeyRole(str, enum.Enum):
    """What a key reaches: ``user``, its owner's files and batches; ``admin``, everyone's."""

    user = "user"
    admin = "admin"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Priorities:
    """The priorities a key's batches may ask for: ``low`` to ``high``, both included."""

    low: int = LOWEST
    high: int = HIGHEST

    def __post_init__(self) -> None:
        if not LOWEST <= self.low <= self.high <= HIGHEST:
            raise KeyLineError(f"priorities {self} must lie within {LOWEST}..{HIGHEST}, the lower end first")

    def __contains__(self, priority: object) -> bool:
        return isinstance(priority, int) and self.low <= priority <= self.high

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}..{self.high}"

    @classmethod
    def parse(cls, text: str) -> Priorities:
        low, sep, high = text.partition("..")
        try:
            ends = (int(text), int(text)) if not sep else (int(low) if low else LOWEST, int(high) if high else HIGHEST)
        except ValueError:
            raise KeyLineError(f"priorities={text!r} is not LOW..HIGH or one number (e.g. priorities=-100..0)") \
                from None
        return cls(*ends)


USER_PRIORITIES, ALL_PRIORITIES = Priorities(LOWEST, NORMAL), Priorities(LOWEST, HIGHEST)


def owner_of(key: str) -> str:
    """The owner a plain key's files and batches are recorded under (never the key itself)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ApiKey:
    """One key and its policy. ``key`` is never shown (not in ``repr``, logs or errors)."""

    key: str = field(repr=False)
    owner: str
    role: KeyRole = KeyRole.user
    priorities: Priorities = USER_PRIORITIES
    policy: OwnerPolicy = DEFAULT
    """Its owner's weight and quotas (the same for every key of that owner)."""

    @property
    def admin(self) -> bool:
        return self.role is KeyRole.admin

    def reaches(self, owner: str | None) -> bool:
        """Whether an object recorded under ``owner`` is this key's to see and act on (None: no such object)."""
        return owner is not None and (self.admin or owner == self.owner)

    @classmethod
    def plain(cls, key: str, role: KeyRole = KeyRole.user) -> ApiKey:
        return cls(key, owner_of(key), role, ALL_PRIORITIES if role is KeyRole.admin else USER_PRIORITIES)


def valid_key(key: str, where: str = "") -> str:
    """``key`` stripped, if it can be a key; ``where``: what gave it, for the error."""
    key = key.strip()
    if len(key) < 16 or not key.isprintable() or " " in key:
        raise KeyLineError(f"{where + ': ' if where else ''}the key must be at least 16 printable characters without "
                           "spaces")
    return key


FIELDS = ("owner", "role", "priorities", *NAMES)


def _fields(text: str) -> tuple[str, dict[str, str]]:
    """A line's key and its fields by name (the comment after them dropped)."""
    words = text.split()
    for i, word in enumerate(words):
        if word.startswith("#") and i:
            words = words[:i]
            break
    key, fields = valid_key(words[0]), {}
    for word in words[1:]:
        name, sep, value = word.partition("=")
        if not sep or name not in FIELDS:
            raise KeyLineError(f"{word!r} is not a field: after the key come owner=NAME, role=user|admin, "
                               f"priorities=LOW..HIGH, weight=W, tokens_per_hour=N, tokens_per_day=N, "
                               "gpu_seconds_per_day=S, refuse_late=true|false")
        if name in fields:
            raise KeyLineError(f"{name}= is given twice")
        fields[name] = value
    return key, fields


def parse_line(text: str, first: bool) -> ApiKey:
    """One line of the key file (neither blank nor a comment); ``first``: the file's first key. Its policy is what
    this line gives (:func:`parse_keys` makes it the owner's, over every line)."""
    key, fields = _fields(text)
    owner = fields["owner"] if "owner" in fields else owner_of(key)
    if not _OWNER.fullmatch(owner):
        raise KeyLineError(f"owner={owner!r}: an owner is 1 to 64 letters, digits, '.', '_', '@' or '-', "
                           "starting with a letter or digit")
    try:
        role = KeyRole(fields["role"]) if "role" in fields else \
            (KeyRole.admin if first and len(fields) == 0 else KeyRole.user)
    except ValueError:
        raise KeyLineError(f"role={fields['role']!r} is not one of {', '.join(r.value for r in KeyRole)}") from None
    default = ALL_PRIORITIES if role is KeyRole.admin else USER_PRIORITIES
    priorities = Priorities.parse(fields["priorities"]) if "priorities" in fields else default
    policy = DEFAULT
    for name in NAMES:
        if name in fields:
            try:
                policy = with_field(policy, name, fields[name])
            except PolicyError as exc:
                raise KeyLineError(f"owner {owner!r}: {exc}") from None
    return ApiKey(key, owner, role, priorities, policy)


def parse_keys(lines: Iterable[str], where: str) -> list[ApiKey]:
    """Every key of a key file's ``lines`` (``where``: the file, for errors, which name it and the line), each with
    its owner's policy: the fields its lines give (one given twice differently is refused, naming both lines)."""
    keys: list[ApiKey] = []
    given: dict[tuple[str, str], tuple[object, int]] = {}  # (owner, field) -> (value, line)
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            got = parse_line(line, first=not keys)
            named = _fields(line)[1]
        except KeyLineError as exc:
            raise KeyLineError(f"{where} line {n}: {exc}") from None
        if any(k.key == got.key for k in keys):
            raise KeyLineError(f"{where} line {n}: this key is already on an earlier line")
        for name in NAMES:
            if name not in named:
                continue
            value, at = given.setdefault((got.owner, name), (getattr(got.policy, name), n))
            if value != getattr(got.policy, name):
                raise KeyLineError(f"{where} line {n}: owner {got.owner!r}: {name}={named[name]} differs from line "
                                   f"{at}'s {name}={value}: an owner has one policy (give it once, or the same)")
        keys.append(got)
    merged: dict[str, OwnerPolicy] = {}
    for (owner, name), (value, _) in given.items():
        merged[owner] = replace(merged.get(owner, DEFAULT), **{name: value})
    return [replace(k, policy=merged.get(k.owner, DEFAULT)) for k in keys]


__all__ = ["ALL_PRIORITIES", "ApiKey", "HIGHEST", "KeyLineError", "KeyRole", "LOWEST", "NORMAL", "Priorities",
           "OwnerPolicy", "USER_PRIORITIES", "owner_of", "parse_keys", "parse_line", "valid_key"]
