"""The batch service's key: every call but ``/health`` carries ``Authorization: Bearer KEY`` (as the OpenAI client
sends it), so the prompts and answers of a batch are its owner's alone — the agent's socket checks its caller the
same way.

The key is made at the service's first start into a file only its user can read (``timeslice.batch.key_file``)
and read back by ``timeslice-verl batch …``; ``TIMESLICE_BATCH_API_KEY`` replaces the file (a Kubernetes Secret,
another user given the key). The file may hold more keys, a line each, each naming its owner, its role and the
priorities it may ask for (:mod:`~timeslice_verl.batch.keys` says the format and the defaults of a plain line):

* a key reaches its owner's files and batches alone; another owner's answer 404 exactly as a missing one does (the
  same status and body: no way to learn that an id exists), and the lists show only its owner's; an ``admin`` key
  reaches everyone's.
* a batch asking for a priority outside its key's is refused (403, ``priority_not_allowed``, naming the allowed
  ones): a plain key asks for at most the users' normal priority 0, the service's own key (the file's first, if
  plain, or ``TIMESLICE_BATCH_API_KEY``) for any, so validation runs (priority 100) keep working.
* ``/health`` answers without a key, but says why the service is unhealthy (a database's address among it) only to
  a caller that sends one.

The file is read again when it changes (:class:`KeyRing`: its inode, size or modification time, looked at on each
request and claim): a key added, removed or given another policy takes effect without a restart. A file that no
longer reads keeps the keys read last, and ``/health`` says what is wrong with it until it is fixed.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from timeslice_verl.batch.keys import ApiKey, KeyLineError, KeyRole, owner_of, parse_keys, parse_line, valid_key
from timeslice_verl.batch.policy import DEFAULT, OwnerPolicy
from timeslice_verl.log import get_logger
from timeslice_verl.private import NotPrivate, create_private, private_file

log = get_logger("batch")

KEY_ENV = "TIMESLICE_BATCH_API_KEY"
OPEN_PATHS = frozenset({"/health"})
"""Answered without a key: a readiness probe learns only that the service is up (with a key: why it is not)."""


class NoKey(NotPrivate):
    """No key can be had: the file is missing (the service never started here) or not private."""


def default_key_file() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "timeslice-verl" / "batch.key"


def key_file(setting: str) -> Path:
    return Path(setting).expanduser() if setting else default_key_file()


def _valid(key: str, where: str) -> str:
    try:
        return valid_key(key, where)
    except KeyLineError as exc:
        raise NoKey(str(exc)) from None


def _read_keys(path: Path) -> list[ApiKey]:
    try:
        keys = parse_keys(path.read_text().splitlines(), str(path))
    except KeyLineError as exc:
        raise NoKey(str(exc)) from None
    if not keys:
        raise NoKey(f"{path}: holds no key")
    return keys


def api_keys(setting: str) -> tuple[list[ApiKey], str]:
    """The keys the service takes with their policies, and where they came from: the environment (one, ``admin``), or
    the file (made on first use with one; a line each, ``#`` comments: a team or user each, whose batches share the
    tenant fairly)."""
    if os.environ.get(KEY_ENV):
        return [ApiKey.plain(_valid(os.environ[KEY_ENV], KEY_ENV), KeyRole.admin)], KEY_ENV
    path = key_file(setting)
    create_private(path, "timeslice.batch.key_file", (secrets.token_urlsafe(32) + "\n").encode())
    private_file(path, "timeslice.batch.key_file", readable_by_others=False)
    return _read_keys(path), str(path)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is edited or replaced (None: it is gone)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class KeyRing:
    """The keys the service takes and their policies, read again from their file when it changes — looked at (one
    ``stat``) on each use, so an edit takes effect at the next request or claim, on every process that reads the
    file, without a restart. A file that no longer reads (a bad line, made public, gone) keeps the keys read last:
    nobody is locked out by a typo; :attr:`problem` says what is wrong until it is fixed."""

    def __init__(self, keys: Sequence[ApiKey], path: Path | None = None, source: str = "") -> None:
        if not keys:
            raise NoKey(f"{source or path or 'the key ring'}: holds no key")
        self.path, self.source = path, source or (str(path) if path else "")
        self._keys, self._owners = list(keys), _owners(keys)
        self._seen = _stamp(path) if path else None
        self._lock = threading.Lock()
        self.problem = ""

    @classmethod
    def of(cls, setting: str) -> KeyRing:
        """The service's keys (:func:`api_keys`), followed in their file unless they came from the environment."""
        keys, source = api_keys(setting)
        return cls(keys, None if source == KEY_ENV else key_file(setting), source)

    def keys(self) -> list[ApiKey]:
        """The keys now (the file read again if it changed since)."""
        if self.path is not None and _stamp(self.path) != self._seen:
            self._reload()
        return self._keys

    def policy(self, owner: str) -> OwnerPolicy:
        """``owner``'s weight and quotas now (the defaults for an owner no key names)."""
        self.keys()
        return self._owners.get(owner, DEFAULT)

    def _reload(self) -> None:
        assert self.path is not None
        with self._lock:
            stamp = _stamp(self.path)
            if stamp == self._seen:
                return
            self._seen = stamp
            try:
                if not private_file(self.path, "timeslice.batch.key_file", readable_by_others=False):
                    raise NoKey(f"{self.path}: does not exist")
                keys = _read_keys(self.path)
            except (NoKey, NotPrivate, OSError) as exc:
                self.problem = f"timeslice.batch.key_file cannot be read again, the keys read before are kept: {exc}"
                log.error("batch: %s", self.problem)
                return
            self._keys, self._owners, self.problem = keys, _owners(keys), ""
            log.info("batch: %s read again: %d key(s)", self.path, len(keys))


def _owners(keys: Sequence[ApiKey]) -> dict[str, OwnerPolicy]:
    return {k.owner: k.policy for k in keys}


def service_keys(setting: str) -> tuple[list[str], str]:
    """The keys alone (:func:`api_keys`)."""
    keys, source = api_keys(setting)
    return [k.key for k in keys], source


def client_key(setting: str, given: str = "") -> str:
    """The key a client sends: ``--api-key``, else the environment, else the service's file (its first key)."""
    if given:
        return _valid(given, "--api-key")
    if os.environ.get(KEY_ENV):
        return _valid(os.environ[KEY_ENV], KEY_ENV)
    path = key_file(setting)
    try:
        if not private_file(path, "timeslice.batch.key_file", readable_by_others=False):
            raise NoKey(f"no batch service key in {path}: start `timeslice-verl batch serve` once on this machine "
                            f"(it makes the key), or give it with --api-key or {KEY_ENV}")
        return _read_keys(path)[0].key
    except PermissionError:
        raise NoKey(f"{path}: not readable by you; give the key with --api-key or {KEY_ENV}") from None
    except NoKey:
        raise
    except NotPrivate as exc:
        raise NoKey(str(exc)) from None


class RequireKey:
    """ASGI middleware: 401 in OpenAI's error shape unless the request carries one of the keys (each compared in
    constant time); the request's ``state.key`` (:class:`~timeslice_verl.batch.keys.ApiKey`) says whose it is and
    what it may do, ``state.owner`` its owner. ``keys``: a :class:`KeyRing` (followed as its file changes), or a
    list — bare strings are read as plain lines of a key file."""

    def __init__(self, app: Any, keys: KeyRing | Sequence[ApiKey | str]) -> None:
        self.app = app
        self.ring = keys if isinstance(keys, KeyRing) else \
            KeyRing([k if isinstance(k, ApiKey) else parse_line(k, first=i == 0) for i, k in enumerate(keys)])
        self._of: list[ApiKey] | None = None
        self._expected: list[tuple[bytes, ApiKey]] = []

    def _match(self, scope: dict) -> tuple[bytes, ApiKey | None]:
        keys = self.ring.keys()
        if keys is not self._of:
            self._expected, self._of = [(f"Bearer {k.key}".encode(), k) for k in keys], keys
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        found = None
        for expected, key in self._expected:  # every key compared: the time says nothing of which matched
            if hmac.compare_digest(given, expected):
                found = key
        return given, found

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given, key = self._match(scope)
        if key is not None:
            scope.setdefault("state", {}).update(key=key, owner=key.owner)
        if key is not None or scope["path"] in OPEN_PATHS:
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


__all__ = ["KEY_ENV", "KeyRing", "NoKey", "RequireKey", "api_keys", "client_key", "default_key_file", "key_file", "owner_of",
           "service_keys"]
