"""The agent's start and stop: whatever a failed start set up is undone."""

from __future__ import annotations

import socket
import subprocess

from agent_support import PY, AgentProc


def test_a_start_that_fails_late_leaves_no_socket_and_no_lock(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        agent = AgentProc(tmp_path)
        done = subprocess.run(
            [PY, "-m", "timeslice_verl", "agent", f"timeslice.agent.socket={agent.socket}",
             "timeslice.agent.backend=sigstop", "timeslice.tenant.url=", f"timeslice.agent.metrics_port={port}",
             f"timeslice.agent.lock_dir={agent.socket.parent}"],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        busy.close()
    assert done.returncode != 0
    assert "Error: the agent could not start: [Errno 98] Address already in use" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "agent stopped" in done.stderr  # the arbiter and the server were shut down in order
    assert not agent.socket.exists()
    agent.start()  # the instance lock was released: the same state file serves a new agent at once
    try:
        assert agent.status()["agent"]["settings"]["agent"]["metrics_port"] == 0
    finally:
        agent.stop()
