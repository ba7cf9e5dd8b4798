"""An autostarted agent runs with the trainer's whole ``agent`` and ``tenant`` sections."""

from __future__ import annotations

import dataclasses
import enum
import os
import signal
import socket

import pytest

from timeslice_verl.config.schema import AgentSettings, TenantSettings, load_settings
from timeslice_verl.config.overrides import compose, to_overrides
from agent_support import eventually


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _not_default(section: type, tmp_path) -> dict:
    """A value different from the schema's default for every key of ``section``."""
    special = {
        "socket": str(tmp_path / "run dir" / "agent.sock"), "state_file": str(tmp_path / "it's state.json"),
        "backend": "sigstop", "gpus": [0, 3], "autostart": True, "metrics_port": _free_port(),
        "metrics_host": "localhost", "cuda_checkpoint_bin": str(tmp_path / "bin" / "cuda-checkpoint"),
        "freeze_off_gpu": True, "url": "", "lock_dir": str(tmp_path / "run dir"), "urls": ["http://127.0.0.1:9", "http://[::1]:9/v1"], "sleep_level": 2,
        "pause_mode": "wait", "across_nodes": True, "warm_up": False, "yield_by": "sleep",
    }
    out = {}
    for f in dataclasses.fields(section):
        if f.name in special:
            out[f.name] = special[f.name]
        else:
            assert isinstance(f.default, float), f"add a non-default value for {section.__name__}.{f.name}"
            out[f.name] = f.default + 1.5
    return out


def _plain(section) -> dict:
    return {k: (str(v) if isinstance(v, enum.Enum) else v) for k, v in dataclasses.asdict(section).items()}


def test_every_agent_and_tenant_key_survives_the_autostart_command(tmp_path):
    settings = load_settings({"agent": _not_default(AgentSettings, tmp_path), "tenant": _not_default(TenantSettings, tmp_path)})
    again = compose("interleave", to_overrides(settings))  # what the agent's command line composes
    assert again.agent == settings.agent
    assert again.tenant == settings.tenant


def test_an_autostarted_agent_runs_with_every_key_the_trainer_set(tmp_path):
    from timeslice_verl.handoff.connect import connect

    agent = _not_default(AgentSettings, tmp_path)
    agent["connect_timeout_s"] = 60.0
    settings = load_settings({"agent": agent, "tenant": _not_default(TenantSettings, tmp_path)})
    os.makedirs(tmp_path / "run dir", mode=0o700)
    client = connect(settings, client_name="test")
    hello = client.hello()
    try:
        assert hello["settings"]["agent"] == _plain(settings.agent)
        assert hello["settings"]["tenant"] == _plain(settings.tenant)
    finally:
        client.close()
        os.kill(hello["pid"], signal.SIGTERM)
        eventually(lambda: not os.path.exists(settings.agent.socket), timeout=30, what="the agent to stop")


def test_without_autostart_the_error_says_how_to_turn_it_on(tmp_path):
    from timeslice_verl.agent.client import AgentError
    from timeslice_verl.handoff.connect import connect

    settings = load_settings({"agent": {"socket": str(tmp_path / "none.sock"), "connect_timeout_s": 0.2}})
    with pytest.raises(AgentError, match="timeslice.agent.autostart=true"):
        connect(settings, client_name="test")
