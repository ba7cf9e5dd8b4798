"""Where the agent's socket and state file live by default: under the user's runtime directory, which only that user
can reach. (``settings``: a :class:`~timeslice_verl.config.schema.TimesliceSettings`; this module sits below it.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def default_runtime_dir() -> Path:
    """A directory only this user can reach: the socket and state file live there."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "timeslice-verl"
    return Path(f"/tmp/timeslice-verl-{os.getuid()}")


def default_socket() -> Path:
    """Where ``timeslice-verl agent`` listens when ``timeslice.agent.socket`` is empty."""
    return default_runtime_dir() / "agent.sock"


def socket_path(settings: Any) -> Path:
    return Path(settings.agent.socket) if settings.agent.socket else default_socket()


def state_path(settings: Any) -> Path:
    if settings.agent.state_file:
        return Path(settings.agent.state_file)
    return socket_path(settings).with_name(socket_path(settings).stem + "-state.json")


__all__ = ["default_runtime_dir", "default_socket", "socket_path", "state_path"]
