"""The batch service's key: every call but ``/health`` carries ``Authorization: Bearer KEY`` (as the OpenAI client
sends it), so the prompts and answers of a batch are its user's alone — the agent's socket checks its caller the
same way.

The key is made at the service's first start into a file only its user can read (``timeslice.batch.key_file``)
and read back by ``timeslice-verl batch …``; ``TIMESLICE_BATCH_API_KEY`` replaces the file (a Kubernetes Secret,
another user given the key).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any, Awaitable, Callable

from timeslice_verl.private import NotPrivate, create_private, private_file

KEY_ENV = "TIMESLICE_BATCH_API_KEY"
OPEN_PATHS = frozenset({"/health"})
"""Answered without a key: a readiness probe learns only that the service is up."""


class NoKey(NotPrivate):
    """No key can be had: the file is missing (the service never started here) or not private."""


def default_key_file() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "timeslice-verl" / "batch.key"


def key_file(setting: str) -> Path:
    return Path(setting).expanduser() if setting else default_key_file()


def _valid(key: str, where: str) -> str:
    key = key.strip()
    if len(key) < 16 or not key.isprintable() or " " in key:
        raise NoKey(f"{where}: the key must be at least 16 printable characters without spaces")
    return key


def service_keys(setting: str) -> tuple[list[str], str]:
    """The keys the service takes, and where they came from: the environment (one), or the file (made on first use
    with one; a line each, ``#`` comments: a team or user each, whose batches share the tenant fairly)."""
    if os.environ.get(KEY_ENV):
        return [_valid(os.environ[KEY_ENV], KEY_ENV)], KEY_ENV
    path = key_file(setting)
    create_private(path, "timeslice.batch.key_file", (secrets.token_urlsafe(32) + "\n").encode())
    private_file(path, "timeslice.batch.key_file", readable_by_others=False)
    keys = [_valid(line, f"{path} line {n}") for n, line in enumerate(path.read_text().splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise NoKey(f"{path}: holds no key")
    return keys, str(path)


def owner_of(key: str) -> str:
    """The owner a key's batches are recorded under (never the key itself): what the fair share is between."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def client_key(setting: str, given: str = "") -> str:
    """The key a client sends: ``--api-key``, else the environment, else the service's file."""
    if given:
        return _valid(given, "--api-key")
    if os.environ.get(KEY_ENV):
        return _valid(os.environ[KEY_ENV], KEY_ENV)
    path = key_file(setting)
    try:
        if not private_file(path, "timeslice.batch.key_file", readable_by_others=False):
            raise NoKey(f"no batch service key in {path}: start `timeslice-verl batch serve` once on this machine "
                            f"(it makes the key), or give it with --api-key or {KEY_ENV}")
        first = next(line for line in path.read_text().splitlines() + [""] if line.strip() and not line.startswith("#"))
        return _valid(first, str(path))
    except PermissionError:
        raise NoKey(f"{path}: not readable by you; give the key with --api-key or {KEY_ENV}") from None
    except NoKey:
        raise
    except NotPrivate as exc:
        raise NoKey(str(exc)) from None


class RequireKey:
    """ASGI middleware: 401 in OpenAI's error shape unless the request carries one of the keys (each compared in
    constant time); the request's ``state.owner`` says whose it is."""

    def __init__(self, app: Any, keys: list[str]) -> None:
        self.app = app
        self._expected = [(f"Bearer {k}".encode(), owner_of(k)) for k in keys]

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        owner = ""
        for expected, who in self._expected:  # every key compared: the time says nothing of which matched
            if hmac.compare_digest(given, expected):
                owner = who
        if owner:
            scope.setdefault("state", {})["owner"] = owner
            await self.app(scope, receive, send)
            return
        what = "a wrong API key" if given else "no API key"
        body = ('{"error": {"message": "%s: send Authorization: Bearer KEY (the key is in the service\'s '
                'timeslice.batch.key_file, or TIMESLICE_BATCH_API_KEY)", "type": "invalid_request_error", '
                '"param": null, "code": "invalid_api_key"}}' % what).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


__all__ = ["KEY_ENV", "NoKey", "RequireKey", "client_key", "default_key_file", "key_file", "owner_of", "service_keys"]
