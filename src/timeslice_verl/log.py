"""The ``timeslice`` logger family: every module logs under it, never with print."""

from __future__ import annotations

import logging

ROOT = "timeslice"


def get_logger(name: str | None = None) -> logging.Logger:
    """``timeslice`` or ``timeslice.<name>``."""
    return logging.getLogger(ROOT if not name else f"{ROOT}.{name}")


def setup_cli_logging(level: str | int = "INFO") -> None:
    """Console logging for the CLI: one line per record, timestamped, under the ``timeslice`` logger."""
    logger = logging.getLogger(ROOT)
    if not any(getattr(h, "_timeslice_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        handler._timeslice_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level if isinstance(level, int) else level.upper())
    logger.propagate = False
