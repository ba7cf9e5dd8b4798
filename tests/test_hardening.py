"""What a careful new user and a security review found: each item, checked."""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent_support import AgentProc, FakeVllmProc, spawn_worker
from timeslice_verl import hookimpl
from timeslice_verl.config.schema import ConfigError, PluginSettings, TimesliceSettings
from timeslice_verl.hooks.events import InitWorkersEvent, RolloutEvent
from timeslice_verl.hooks.manager import PluginLoadError, TimesliceManager
from timeslice_verl.testing import RecordingPlugin, make_lifecycle

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "timeslice_verl"]
HAS_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAS_VERL, reason="needs verl installed (pip install '.[verl]')")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)


# --------------------------------------------------------------------------- tests and the tree


def test_tests_run_in_a_temporary_directory(tmp_path):
    assert Path.cwd() == tmp_path


def test_the_test_kit_loads_only_the_entry_point_plugins_a_test_names():
    installed = {ep.name for ep in importlib.metadata.entry_points(group="timeslice_verl")}
    settings = TimesliceSettings(job="j", plugins=PluginSettings(disabled=["agent"]))
    lc = make_lifecycle(settings=settings, load_installed=True, bundled=("agent", "timeline", "metrics"))
    assert {p.name for p in lc.manager.plugins()} == {"timeline", "metrics"}
    assert make_lifecycle(settings=TimesliceSettings(job="j"), load_installed=True).manager.plugins() == []
    if "csv" in installed:
        named = make_lifecycle(settings=settings, load_installed=True, entry_points=["csv"])
        assert named.manager.get("csv") is not None


def test_backend_test_pids_are_distinct_processes_of_our_own():
    import test_freeze_backend as tb

    pids = {tb.P1, tb.P2, tb.P3}
    assert len(pids) == 3 and not pids & {1, os.getpid(), os.getppid()}


@needs_verl
def test_the_ray_actor_test_passes_when_the_harness_file_is_collected_too(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests/test_adapters.py"),
         str(REPO / "tests/verl_harness.py"), "-k", "real_ray_actor"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


# --------------------------------------------------------------------------- config and CLI


def test_config_accepts_the_trainers_option_syntax():
    observe = json.loads(cli("config", "--json", "+timeslice=observe").stdout)["timeslice"]
    assert observe["plugins"]["disabled"] == ["agent"]
    off = cli("config", "+timeslice=off").stdout.splitlines()
    assert off[0] == "+timeslice=off" and "timeslice.enabled=false" in off


@pytest.mark.parametrize("args, needle", [
    (["+timeslice=obsreve"], "Available options in 'timeslice': interleave observe off"),
    (["trainer.total_epochs=3"], "trainer.total_epochs"),
    (["timeslice.agent.backend=cdua"], "timeslice.agent.backend"),
    (["timeslice.tenant.pause_mode=kep"], "timeslice.tenant.pause_mode"),
    (["timeslice.tenant.url=localhost"], "timeslice.tenant.url"),
])
def test_config_refuses_what_it_cannot_apply(args, needle):
    proc = cli("config", *args)
    assert proc.returncode != 0 and needle in proc.stderr, proc.stderr


@needs_verl
def test_bad_values_fail_at_verls_own_composition():
    proc = subprocess.run(
        [sys.executable, "-m", "verl.experimental.fully_async_policy.fully_async_main", "--cfg", "job",
         "+timeslice=interleave", "timeslice.agent.backend=cdua"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "timeslice.agent.backend" in proc.stdout + proc.stderr and "cdua" in proc.stdout + proc.stderr


def test_values_that_only_a_run_can_check_fail_before_launch():
    from omegaconf import OmegaConf

    from timeslice_verl.adapters.preflight import preflight

    with pytest.raises(ConfigError, match="timeslice.tenant.url"):
        preflight(OmegaConf.create({"timeslice": {"tenant": {"url": "localhost"}}}))


def test_a_misspelled_disabled_plugin_is_an_error_with_a_suggestion():
    with pytest.raises(PluginLoadError, match="did you mean 'metrics'"):
        TimesliceManager().load(PluginSettings(disabled=["metrix"]))


def test_plugins_lists_disabled_plugins_as_disabled_and_shows_versions():
    proc = cli("plugins", "timeslice.plugins.disabled=[agent]", "timeslice.plugins.enabled=[]")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert "disabled" in lines["agent"] and "registered" not in lines["agent"]
    assert "bundled (timeslice-verl " in lines["timeline"]


def test_cli_errors_are_messages_not_tracebacks():
    bad_level = cli("--log-level", "foo", "options")
    assert bad_level.returncode == 2 and "Traceback" not in bad_level.stderr and "--log-level" in bad_level.stderr
    no_gpu = cli("demo", "--device", "cuda", "--steps", "1")
    assert no_gpu.returncode == 2 and "Traceback" not in no_gpu.stderr and "--device cuda needs an NVIDIA GPU" in no_gpu.stderr


def test_help_texts_carry_no_rest_markup():
    for command in ([], ["agent"], ["options"], ["config"], ["status"], ["doctor"], ["demo"]):
        out = cli(*command, "--help").stdout
        assert "``" not in out, command


def test_doctor_accepts_no_tenant_and_flags_the_test_backend(tmp_path):
    proc = cli("doctor", f"timeslice.agent.socket={tmp_path}/none.sock", "timeslice.tenant.url=", "timeslice.agent.backend=sigstop")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert any(line.startswith("PASS  batch tenant") for line in lines)
    assert any(line.startswith("FAIL  agent backend frees GPU memory") and "CPU test backend" in line for line in lines)


def test_the_last_handoff_reaches_the_observers(tmp_path):
    from test_agent_plugin import lifecycle_for

    from timeslice_verl.testing import fake_event_sequence, play

    vllm = FakeVllmProc()
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    worker = spawn_worker("plugin-job")
    try:
        recorder = RecordingPlugin()
        play(lifecycle_for(tmp_path, agent, recorder), fake_event_sequence(2))
    finally:
        worker.kill()
        agent.stop()
        vllm.stop()
    assert [(e.action, e.point) for e in recorder.events("handoff")][-1] == ("release", "timeslice_stop")
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    last_handoff = max(i for i, r in enumerate(records) if r["hook"] == "handoff")
    assert records[last_handoff]["point"] == "timeslice_stop" and records[-1]["hook"] == "timeslice_stop"


# --------------------------------------------------------------------------- adapters and the dispatcher


@needs_verl
def test_a_save_that_raises_is_not_reported_as_saved(tmp_path, monkeypatch):
    import verl_harness as h
    from test_adapters import events, run, verl_trainer_module

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(h.FakeActorGroup, "save_checkpoint", broken)
    cfg = h.trainer_config(tmp_path, trigger=1, extra=["trainer.save_freq=1"])
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=2)
    with pytest.raises(OSError, match="disk full"):
        run(trainer)
    ends = [r for r in events(tmp_path / "events.jsonl") if r["hook"] == "save_checkpoint_end"]
    assert ends and ends[0]["saved"] is False


@needs_verl
def test_weight_sync_end_says_when_a_save_follows(tmp_path):
    import verl_harness as h
    from test_adapters import events, run, verl_trainer_module

    cfg = h.trainer_config(tmp_path, trigger=1, extra=["trainer.save_freq=2"])
    run(h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=3))
    ends = [r for r in events(tmp_path / "events.jsonl") if r["hook"] == "weight_sync_end" and not r["initial"]]
    assert [r["save_follows"] for r in ends] == [False, True, False]


class _Started:
    name = "started"

    def __init__(self) -> None:
        self.seen: list[str] = []

    @hookimpl
    def timeslice_start(self) -> None:
        self.seen.append("timeslice_start")

    @hookimpl
    def post_rollout(self) -> None:
        self.seen.append("post_rollout")


class _FailsToStart:
    name = "fails"

    @hookimpl
    def timeslice_start(self) -> None:
        raise RuntimeError("no agent")


def test_a_lifecycle_that_failed_to_start_delivers_no_further_events():
    started = _Started()
    lc = make_lifecycle(started, _FailsToStart())
    with pytest.raises(RuntimeError, match="no agent"):
        lc.init_workers_begin(lc.event(InitWorkersEvent))
    with pytest.raises(RuntimeError, match="did not start"):
        lc.post_rollout(lc.event(RolloutEvent))
    assert "post_rollout" not in started.seen


class _UsesAsyncio:
    name = "asyncio-user"

    def __init__(self) -> None:
        self.threads: list[int] = []

    @hookimpl
    def post_rollout(self) -> None:
        self.threads.append(threading.get_ident())
        asyncio.run(asyncio.sleep(0))  # impossible on a thread that runs an event loop


def test_hooks_from_synchronous_seams_run_off_the_event_loop():
    plugin = _UsesAsyncio()
    lc = make_lifecycle(plugin)

    async def trainer_actor() -> int:  # a sync verl method called from the actor's loop
        lc.post_rollout(lc.event(RolloutEvent))
        return threading.get_ident()

    loop_thread = asyncio.run(trainer_actor())
    assert plugin.threads and plugin.threads[0] != loop_thread


# --------------------------------------------------------------------------- packaging


def test_the_license_is_shipped_and_the_design_is_in_the_repository():
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()
    assert (REPO / "docs" / "architecture.md").exists()
    for path in [*(REPO / "src").rglob("*.py"), REPO / "pyproject.toml", REPO / "README.md"]:
        assert "DESIGN.md" not in path.read_text(), path


def test_the_sdist_includes_what_the_tests_import():
    tomllib = pytest.importorskip("tomllib")

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    for needed in ("src", "conf", "tests", "hooks", "benchmarks", "docs", "deploy", "LICENSE"):
        assert needed in include, needed
