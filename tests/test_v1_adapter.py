"""The v1 adapter on verl 0.9's real v1 ``separate_async`` trainer (CPU; see v1_harness for what is faked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None or importlib.util.find_spec("transfer_queue") is None,
    reason="needs verl and TransferQueue installed (pip install '.[verl]')",
)

if importlib.util.find_spec("verl") is not None and importlib.util.find_spec("transfer_queue") is not None:
    import v1_harness as h

from timeslice_verl.config.schema import ConfigError

KEYS = ("hook", "step", "param_version", "initial", "synced", "local_step", "samples", "force", "saved", "reason", "point")


def events(tmp: Path) -> list[dict]:
    path = tmp / "events.jsonl"
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(line).items() if k in KEYS and v is not None} for line in path.read_text().splitlines()]


def expected_sequence(steps: int, sync_step: int, save_at: tuple[int, ...] = ()) -> list[dict]:
    mini = 2
    out = [
        {"hook": "timeslice_start", "step": 0, "param_version": 0, "reason": ""},
        {"hook": "init_workers_begin", "step": 0, "param_version": 0},
        {"hook": "init_workers_end", "step": 0, "param_version": 0},
        {"hook": "weight_sync_begin", "step": 0, "param_version": 0, "initial": True},
        {"hook": "weight_sync_end", "step": 0, "param_version": 0, "initial": True, "synced": True},
    ]
    for step in range(1, steps + 1):
        for local in range(1, sync_step + 1):
            out += [
                {"hook": "post_rollout", "step": step, "param_version": step - 1, "samples": mini},
                {"hook": "pre_train_step", "step": step, "param_version": step - 1, "samples": mini, "local_step": local},
            ]
        if step in save_at:  # v1 saves before it pushes the weights
            out += [
                {"hook": "save_checkpoint_begin", "step": step, "param_version": step - 1, "force": step == steps},
                {"hook": "save_checkpoint_end", "step": step, "param_version": step - 1, "force": step == steps, "saved": True},
            ]
        out += [
            {"hook": "weight_sync_begin", "step": step, "param_version": step - 1, "initial": False},
            {"hook": "weight_sync_end", "step": step, "param_version": step, "initial": False, "synced": True},
        ]
    out.append({"hook": "timeslice_stop", "step": steps + 1, "param_version": steps, "reason": "finished"})
    return out


@pytest.mark.parametrize("sync_step", [1, 2])
def test_exact_event_sequence(tmp_path, monkeypatch, sync_step):
    fakes = h.Fakes(monkeypatch, steps=3)
    trainer = h.build(h.v1_config(tmp_path, sync_step=sync_step), fakes)
    h.run(trainer, fakes)
    assert events(tmp_path) == expected_sequence(3, sync_step)
    # verl's own work really ran: the initial push, one push per step, sync_step updates per step
    assert [e for e in fakes.log if e[0] == "update_weights"] == [("update_weights", s) for s in range(4)]
    assert len([e for e in fakes.log if e[0] == "update_actor"]) == 3 * sync_step


def test_the_backlog_is_read_off_the_replay_buffer_per_mini_batch(tmp_path, monkeypatch):
    """What the break-even rule reads at a v1 release: groups sampleable for the next mini-batch, and its size."""
    from timeslice_verl.adapters.common import v1_backlog

    fakes = h.Fakes(monkeypatch)
    trainer = h.build(h.v1_config(tmp_path, sync_step=2), fakes)
    mini_batch = int(trainer.config.data.train_batch_size) // 2
    trainer.replay_buffer = fakes.buffer  # as verl's _setup does
    fakes.buffer.ready = ["g1", "g2", "g3"]
    assert v1_backlog(trainer) == (3, mini_batch)


def test_saves_fire_their_events_and_a_save_that_raises_is_not_saved(tmp_path, monkeypatch):
    fakes = h.Fakes(monkeypatch, steps=3)
    trainer = h.build(h.v1_config(tmp_path, sync_step=1, extra=["trainer.save_freq=2"]), fakes)
    h.run(trainer, fakes)
    assert events(tmp_path) == expected_sequence(3, 1, save_at=(2, 3))
    assert [e for e in fakes.log if e[0] == "save_checkpoint"] == [("save_checkpoint", 2), ("save_checkpoint", 3)]


def test_without_the_section_nothing_fires_and_verl_runs_the_same(tmp_path, monkeypatch):
    import logging

    from verl.trainer.ppo.v1 import trainer_separate_async

    # Plain verl 0.9.1 raises in _setup with hybrid_engine=False while its INFO logging is on (a
    # logger.info(..., flush=True) call); the inert adapter leaves that as it is, so run it as with
    # VERL_LOGGING_LEVEL=WARN.
    monkeypatch.setattr(trainer_separate_async.logger, "level", logging.WARNING)
    fakes = h.Fakes(monkeypatch, steps=3)
    trainer = h.build(h.v1_config(tmp_path, sync_step=2, timeslice=False), fakes)
    h.run(trainer, fakes)
    assert events(tmp_path) == []
    assert [e[0] for e in fakes.log].count("update_weights") == 4 and [e[0] for e in fakes.log].count("update_actor") == 6


def test_an_exception_fires_trainer_exception_once_and_propagates(tmp_path, monkeypatch):
    fakes = h.Fakes(monkeypatch, steps=3, fail_update_at=2)
    trainer = h.build(h.v1_config(tmp_path, sync_step=1), fakes)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        h.run(trainer, fakes)
    got = events(tmp_path)
    assert [e["hook"] for e in got].count("trainer_exception") == 1
    crash = next(e for e in got if e["hook"] == "trainer_exception")
    assert crash["point"] == "fit" and crash["step"] == 2
    assert got[-1] == {"hook": "timeslice_stop", "step": 2, "param_version": 1, "reason": "error"}


def test_the_adapter_takes_the_registry_entry_and_a_name_of_its_own():
    from verl.trainer.ppo.v1 import PPOTrainerSeparateAsync, get_trainer_cls

    cls = get_trainer_cls("separate_async")
    assert cls is get_trainer_cls("timeslice") and issubclass(cls, PPOTrainerSeparateAsync) and cls is not PPOTrainerSeparateAsync


@pytest.mark.parametrize("extra, key, needle", [
    (["actor_rollout_ref.hybrid_engine=True", "timeslice.plugins.disabled=[metrics]"], "actor_rollout_ref.hybrid_engine",
     "validation and the first step"),
    (["actor_rollout_ref.hybrid_engine=True", "trainer.v1.separate_async.hybrid_rollout.enable_switch=True",
      "timeslice.plugins.disabled=[metrics]"],
     "actor_rollout_ref.hybrid_engine", "enable_switch lends them to verl's own rollout"),
    (["timeslice.adapter=stock"], "timeslice.adapter", "use 'auto' or 'v1'"),
])
def test_what_time_slicing_cannot_serve_fails_before_anything_is_built(tmp_path, monkeypatch, extra, key, needle):
    fakes = h.Fakes(monkeypatch)
    with pytest.raises(ConfigError, match=needle) as info:
        h.build(h.v1_config(tmp_path, sync_step=1, extra=extra), fakes)
    assert info.value.key == key
    assert fakes.log == [], "nothing was set up"


def test_the_hybrid_switch_is_fine_when_only_observing(tmp_path, monkeypatch):
    from timeslice_verl.adapters.preflight import preflight

    cfg = h.v1_config(tmp_path, sync_step=1, extra=["actor_rollout_ref.hybrid_engine=True", "timeslice.plugins.disabled=[agent]"])
    preflight(cfg, v1=True)


def test_other_v1_modes_are_refused_when_launched_through_run_ppo(tmp_path):
    from timeslice_verl.adapters.preflight import preflight

    cfg = h.v1_config(tmp_path, sync_step=1, extra=["trainer.v1.trainer_mode=sync"])
    with pytest.raises(ConfigError, match="separate_async") as info:
        preflight(cfg, v1=True)
    assert info.value.key == "trainer.v1.trainer_mode"
    with pytest.raises(ConfigError, match="not verl's v1 trainer"):
        preflight(h.v1_config(tmp_path, sync_step=1, extra=["timeslice.adapter=v1"]), v1=False)


def _v1_handoffs(tmp_path, monkeypatch, *extra: str, sampleable: int | None = None) -> list[tuple[str, str]]:
    from agent_support import AgentProc, FakeVllmProc, spawn_worker

    # the first backlog read goes through Ray, which a loaded 2-core machine warms up slowly: this test is about
    # what the handoff decides from the backlog, not the bound on a slow first read
    monkeypatch.setattr("timeslice_verl.handoff.backlog.FIRST_READ_TIMEOUT_S", 300.0)
    vllm = FakeVllmProc()
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    worker = spawn_worker("v1-test")
    try:
        fakes = h.Fakes(monkeypatch, steps=2)
        fakes.buffer.sampleable = sampleable
        cfg = h.v1_config(tmp_path, sync_step=1, extra=[
            f"timeslice.agent.socket={agent.socket}", "timeslice.plugins.disabled=[metrics]", "timeslice.tenant.url=",
            "timeslice.handoff.prepare=false", *extra,
        ])
        h.run(h.build(cfg, fakes), fakes)
        return [(e["action"], e["point"]) for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
                if e["hook"] == "handoff"]
    finally:
        worker.kill()
        agent.stop()
        vllm.stop()


def test_the_agent_plugin_skips_every_release_while_the_replay_buffer_is_ahead(tmp_path, monkeypatch):
    """The next mini-batch is always sampleable: no valley to lend, so the trainer never lets go of its GPU."""
    assert _v1_handoffs(tmp_path, monkeypatch, sampleable=10**6) == [
        ("acquire", "init_workers_begin"), ("skip", "init_workers_end"),
        ("skip", "weight_sync_end"), ("skip", "weight_sync_end"), ("skip", "weight_sync_end"),
        ("release", "timeslice_stop"),
    ]


def test_the_agent_plugin_hands_the_gpu_over_on_v1(tmp_path, monkeypatch):
    handoffs = _v1_handoffs(tmp_path, monkeypatch, "timeslice.handoff.break_even_margin=0")  # every valley lent
    assert handoffs == [
        ("acquire", "init_workers_begin"), ("release", "init_workers_end"),
        ("acquire", "weight_sync_begin"), ("release", "weight_sync_end"),
        ("acquire", "pre_train_step"), ("release", "weight_sync_end"),
        ("acquire", "pre_train_step"), ("release", "weight_sync_end"),
        ("release", "timeslice_stop"),
    ]
