"""Reaching the node's agent from a trainer, and starting one when none answers (``agent.autostart``).

An autostarted agent gets the trainer's whole ``agent`` and ``tenant`` sections as overrides
(:func:`timeslice_verl.config.overrides.to_overrides`): it runs with exactly the settings the trainer was given.
"""

from __future__ import annotations

import os
import subprocess
import sys

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.config.schema import TimesliceSettings, socket_path
from timeslice_verl.config.overrides import to_overrides
from timeslice_verl.log import get_logger

log = get_logger("handoff")


def agent_command(settings: TimesliceSettings) -> list[str]:
    """The command that starts an agent with ``settings`` (no shell: a list of arguments)."""
    return [sys.executable, "-m", "timeslice_verl", "agent", *to_overrides(settings)]


def connect(settings: TimesliceSettings, *, client_name: str) -> AgentClient:
    """A connected client of the node's agent (autostarting one if allowed); logs whom it reached."""
    path = socket_path(settings)
    client = AgentClient(path, connect_timeout_s=settings.agent.connect_timeout_s, client=client_name)
    if settings.agent.autostart and not path.exists():  # nobody to wait for: start one now
        start_agent(settings)
    try:
        hello = client.hello()
    except AgentError as exc:
        if not settings.agent.autostart:
            raise AgentError(exc.code, f"{exc.message} (or set timeslice.agent.autostart=true)") from None
        start_agent(settings)
        hello = client.hello()
    log.info("[timeslice] %s: agent pid %s on %s, backend %s%s", client_name, hello.get("pid"), path, hello.get("backend"),
             "" if hello.get("frees_gpu_memory") else " (CPU TEST BACKEND: GPU memory is not freed)")
    return client


def start_agent(settings: TimesliceSettings) -> None:
    """Start ``timeslice-verl agent`` in its own session, logging beside its socket."""
    path = socket_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path = path.with_name("agent.log")
    # O_NOFOLLOW: never write through a link someone planted at the log's path
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "a") as out:
        subprocess.Popen(agent_command(settings), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                         close_fds=True)
    log.info("[timeslice] started an agent (log %s)", log_path)


__all__ = ["agent_command", "connect", "start_agent"]
