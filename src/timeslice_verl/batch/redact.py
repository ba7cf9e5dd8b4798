"""A DSN's password never reaches a log, an error or a warning — ours or a library's.

libpq quotes what it could not read of a DSN (``invalid percent-encoded token: "<password>"``, a whole URI it could
not parse), and psycopg_pool logs each failed connection with that message. :func:`protect` registers a DSN: from
then on the records of the ``psycopg`` loggers, the warnings shown, and any text passed through :func:`redact` have
its password, the DSN itself and each quoted piece of it replaced by ``***``.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from typing import Any

MASK = "***"
LIBRARY_LOGGERS = ("psycopg", "psycopg.pool")
"""psycopg's and psycopg_pool's loggers (a logger's filter sees only the records made on that logger)."""

_URI_PASSWORD = re.compile(r"://[^:/@\s]*:([^@\s]+)@")
_KV_PASSWORD = re.compile(r"password\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)
_QUOTED = re.compile(r'"([^"]{3,})"')
_KEYWORDS = {"host", "hostaddr", "port", "user", "dbname", "password", "sslmode", "options", "application_name"}
_lock = threading.Lock()
_dsns: list[str] = []
_secrets: list[str] = []


def secrets_of(dsn: str) -> list[str]:
    """What of ``dsn`` must never be shown: its password (however malformed the DSN) and the DSN itself."""
    found = [m.group(1) for m in _URI_PASSWORD.finditer(dsn)]
    found += [m.group(1).strip("'") for m in _KV_PASSWORD.finditer(dsn)]
    return sorted({s for s in [*found, dsn.strip()] if s}, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` without any registered DSN's secrets, nor a quoted piece of such a DSN (what libpq quotes of it)."""
    if not _secrets or not text:
        return text
    for secret in _secrets:
        text = text.replace(secret, MASK)

    def piece(m: re.Match[str]) -> str:
        inner = m.group(1)
        if inner.lower() in _KEYWORDS or not any(inner in dsn for dsn in _dsns):
            return m.group(0)
        return f'"{MASK}"'

    return _QUOTED.sub(piece, text)


class RedactingFilter(logging.Filter):
    """Rewrites a record's message (and its traceback) without the secrets, before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit: shown as its format alone
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


FILTER = RedactingFilter()


def _redacting(show: Any) -> Any:
    """``warnings.showwarning`` that shows the warning without the secrets (``logging.captureWarnings`` included)."""

    def showwarning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                    line: str | None = None) -> None:
        show(redact(str(message)), category, filename, lineno, file, line)

    showwarning.redacting = True  # type: ignore[attr-defined]
    return showwarning


def protect(dsn: str) -> None:
    """From now on, ``dsn``'s secrets are redacted from library logs, warnings shown and :func:`redact`."""
    with _lock:
        if dsn in _dsns:
            return
        _dsns.append(dsn)
        _secrets[:] = sorted({*_secrets, *secrets_of(dsn)}, key=len, reverse=True)
        for name in LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            if FILTER not in logger.filters:
                logger.addFilter(FILTER)
        if not getattr(warnings.showwarning, "redacting", False):
            warnings.showwarning = _redacting(warnings.showwarning)


__all__ = ["MASK", "RedactingFilter", "protect", "redact", "secrets_of"]
