"""The verl adapters against verl's real FullyAsyncTrainer (GPU work faked at the boundaries)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

import verl_harness as h  # noqa: E402
from verl.experimental.fully_async_policy import fully_async_trainer as verl_trainer_module  # noqa: E402

from timeslice_verl.adapters import hooked, stock  # noqa: E402
from timeslice_verl.adapters.common import choose_adapter  # noqa: E402
from timeslice_verl.adapters.transfer import Transfer, captured_transfer, transfer_of  # noqa: E402
from timeslice_verl.config.schema import ConfigError  # noqa: E402
from timeslice_verl.testing import fake_event_sequence  # noqa: E402

FIELDS = ("hook", "step", "param_version", "initial", "synced", "samples", "required_samples", "local_step",
          "force", "saved", "point", "error_type", "reason", "adapter")


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def trimmed(records: list[dict], drop: tuple[str, ...] = ("adapter",)) -> list[dict]:
    return [{k: r[k] for k in FIELDS if k in r and k not in drop} for r in records]


def run(trainer) -> None:
    asyncio.run(h.run_like_fully_async_main(trainer))


def test_stock_adapter_is_installed_by_verls_own_entry_point():
    # `import verl` loaded our `verl.plugins` entry point, which wrapped the trainer on import.
    assert stock.is_installed(verl_trainer_module.FullyAsyncTrainer)
    raw = verl_trainer_module.FullyAsyncTrainer.__ray_actor_class__
    for name in stock.SEAMS:
        method = raw.__dict__[name]
        assert getattr(method, "__timeslice_seam__", None) == name
        assert asyncio.iscoroutinefunction(method) == asyncio.iscoroutinefunction(method.__wrapped__)
    assert stock.install(verl_trainer_module.FullyAsyncTrainer) is raw  # idempotent
    assert raw.__dict__["fit"].__wrapped__ is not raw.__dict__["fit"]
    assert not hasattr(raw.__dict__["fit"].__wrapped__, "__timeslice_seam__")  # never wrapped twice


def test_trigger_1_exact_sequence_with_a_save(ray_local, tmp_path):
    cfg = h.trainer_config(tmp_path, trigger=1, extra=["trainer.save_freq=2"])
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=3)
    run(trainer)
    got = trimmed(events(tmp_path / "events.jsonl"))
    S = dict(samples=2, required_samples=2)
    expected = [
        {"hook": "timeslice_start", "step": 0, "param_version": 0, "reason": ""},
        {"hook": "init_workers_begin", "step": 0, "param_version": 0},
        {"hook": "init_workers_end", "step": 0, "param_version": 0},
        {"hook": "weight_sync_begin", "step": 0, "param_version": 0, "initial": True, "synced": None},
        {"hook": "weight_sync_end", "step": 0, "param_version": 0, "initial": True, "synced": True},
    ]
    for step in (1, 2, 3):
        expected += [
            {"hook": "post_rollout", "step": step, "param_version": step - 1, **S},
            {"hook": "pre_train_step", "step": step, "param_version": step - 1, "samples": 2, "local_step": 1},
            {"hook": "weight_sync_begin", "step": step, "param_version": step, "initial": False, "synced": None},
            {"hook": "weight_sync_end", "step": step, "param_version": step, "initial": False, "synced": True},
        ]
        if step == 2:  # save_freq=2: version 2 is saved after its sync
            expected += [
                {"hook": "save_checkpoint_begin", "step": 2, "param_version": 2, "force": False, "saved": None},
                {"hook": "save_checkpoint_end", "step": 2, "param_version": 2, "force": False, "saved": True},
            ]
    expected += [  # fit's final forced save of version 3
        {"hook": "save_checkpoint_begin", "step": 4, "param_version": 3, "force": True, "saved": None},
        {"hook": "save_checkpoint_end", "step": 4, "param_version": 3, "force": True, "saved": True},
        {"hook": "timeslice_stop", "step": 4, "param_version": 3, "reason": "finished"},
    ]
    assert got == expected
    # the originals really ran: 1 pre-fit + 3 syncs, 3 updates, 2 saves
    log = h.FakeWorkerGroup.log
    assert [e for e in log if e[0] == "update_weights"] == [("update_weights", v) for v in (0, 1, 2, 3)]
    assert [e for e in log if e[0] == "save_checkpoint"] == [("save_checkpoint", 2), ("save_checkpoint", 3)]
    # the scripted sequence plugin authors test against follows the real one
    scripted = [hook for hook, *_ in fake_event_sequence(3, required_samples=2, save_at=(2,))]
    real = [r["hook"] for r in got if r["hook"] not in ("timeslice_start", "timeslice_stop")]
    assert scripted == real[: len(scripted)]


def test_the_backlog_is_read_off_verls_trainer_and_its_message_queue(ray_local, tmp_path):
    """What the break-even rule reads at a release: samples queued for the next step and samples it needs."""
    from timeslice_verl.adapters.common import fully_async_backlog, lifecycle_for

    cfg = h.trainer_config(tmp_path, trigger=1)
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=3)
    required = trainer.required_samples
    assert fully_async_backlog(trainer) == (3 * required, required)
    trainer.message_queue_client.remaining = 1
    assert lifecycle_for(trainer, "stock").backlog() == (1, required)


def test_the_backlog_counts_the_samples_the_trainer_already_took_for_its_batch(ray_local):
    """verl's trainer pops samples one at a time as they come: mid-collection, those it holds count (verl's own
    message queue actor and client, as fully_async_main makes them)."""
    import ray
    from omegaconf import OmegaConf
    from verl.experimental.fully_async_policy.message_queue import MessageQueue, MessageQueueClient

    from timeslice_verl.adapters.common import fully_async_backlog

    client = MessageQueueClient(MessageQueue.remote(OmegaConf.create({}), max_queue_size=16))
    trainer = type("Trainer", (), {})()
    trainer.message_queue_client, trainer.required_samples = client, 4
    for i in range(3):
        ray.get(client.queue_actor.put_sample.remote(f"sample {i}"))
    assert fully_async_backlog(trainer) == (3, 4)
    client.get_sample_sync()  # the trainer took one for its batch: three still toward it, not two
    assert fully_async_backlog(trainer) == (3, 4)
    for i in range(3, 7):
        ray.get(client.queue_actor.put_sample.remote(f"sample {i}"))
    for _ in range(3):
        client.get_sample_sync()  # its batch is complete (4 taken): the 3 left are toward the next one
    assert fully_async_backlog(trainer) == (3, 4)


def test_trigger_2_syncs_every_other_step(ray_local, tmp_path):
    cfg = h.trainer_config(tmp_path, trigger=2)
    run(h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=4))
    syncs = [(r["step"], r["param_version"], r["synced"]) for r in events(tmp_path / "events.jsonl") if r["hook"] == "weight_sync_end"]
    assert syncs == [(0, 0, True), (1, 0, False), (2, 1, True), (3, 1, False), (4, 2, True)]
    steps = [(r["step"], r["local_step"]) for r in events(tmp_path / "events.jsonl") if r["hook"] == "pre_train_step"]
    assert steps == [(1, 1), (2, 2), (3, 1), (4, 2)]


def test_without_the_section_nothing_fires_and_originals_behave_the_same(ray_local, tmp_path):
    cfg = h.trainer_config(tmp_path, trigger=1, timeslice=False)
    run(h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=3))
    wrapped_log = list(h.FakeWorkerGroup.log)
    assert not (tmp_path / "events.jsonl").exists()

    stock.uninstall(verl_trainer_module.FullyAsyncTrainer)
    try:
        assert not stock.is_installed(verl_trainer_module.FullyAsyncTrainer)
        run(h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=3))
        plain_log = list(h.FakeWorkerGroup.log)
    finally:
        stock.install(verl_trainer_module.FullyAsyncTrainer)
    assert wrapped_log == plain_log
    assert len(plain_log) == 1 + 4 + 3  # init_model, 4 weight pushes, 3 actor updates


def test_disabled_section_is_inert(ray_local, tmp_path):
    cfg = h.trainer_config(tmp_path, trigger=1, extra=["timeslice.enabled=false"])
    run(h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=2))
    assert not (tmp_path / "events.jsonl").exists()


def test_exception_in_a_step_fires_once_and_propagates(ray_local, tmp_path):
    cfg = h.trainer_config(tmp_path, trigger=1)
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=4, fail_sync_at=2)
    with pytest.raises(RuntimeError, match="NCCL broadcast failed at version 2"):
        run(trainer)
    records = events(tmp_path / "events.jsonl")
    crashes = [r for r in records if r["hook"] == "trainer_exception"]
    assert len(crashes) == 1
    assert crashes[0]["point"] == "update_weights" and crashes[0]["error_type"] == "RuntimeError"
    assert "NCCL broadcast failed" in crashes[0]["message"]
    assert records[-1]["hook"] == "timeslice_stop" and records[-1]["reason"] == "error"
    assert [r["hook"] for r in records].index("trainer_exception") < len(records) - 1


def test_exception_in_the_prefit_sync_fires_once(ray_local, tmp_path):
    cfg = h.trainer_config(tmp_path, trigger=1)
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=2, fail_sync_at=0)
    with pytest.raises(RuntimeError, match="version 0"):
        run(trainer)
    hooks = [(r["hook"], r.get("point")) for r in events(tmp_path / "events.jsonl")]
    assert hooks[-2:] == [("weight_sync_begin", None), ("trainer_exception", "update_weights")]


@pytest.fixture
def hooked_verl(monkeypatch):
    """verl as the fork ships it: trainer registry in the trainer module, hooked base class."""
    import verl_hooked_standin as standin

    monkeypatch.setattr(verl_trainer_module, "register_trainer", standin.register_trainer, raising=False)
    standin.TRAINER_REGISTRY.clear()
    cls = hooked.install(standin)
    assert cls is standin.TRAINER_REGISTRY["timeslice"]
    yield standin
    standin.TRAINER_REGISTRY.clear()
    del standin.__timeslice_hooked_trainer__


@pytest.mark.parametrize("trigger, save", [(1, "trainer.save_freq=2"), (2, "trainer.save_freq=1")])
def test_fork_adapter_fires_the_identical_sequence(ray_local, tmp_path, hooked_verl, trigger, save):
    stock_dir, fork_dir = tmp_path / "stock", tmp_path / "fork"
    run(h.build_trainer(verl_trainer_module.FullyAsyncTrainer, h.trainer_config(stock_dir, trigger=trigger, extra=[save]), steps=4))
    fork_cls = hooked_verl.get_trainer_class("timeslice")
    run(h.build_trainer(fork_cls, h.trainer_config(fork_dir, trigger=trigger, extra=[save]), steps=4))
    stock_events, fork_events = events(stock_dir / "events.jsonl"), events(fork_dir / "events.jsonl")
    assert stock_events[0]["adapter"] == "stock" and fork_events[0]["adapter"] == "hooked"
    assert len(fork_events) > 20
    assert trimmed(fork_events) == trimmed(stock_events)


def test_fork_adapter_exception_fires_once(ray_local, tmp_path, hooked_verl):
    cls = hooked_verl.get_trainer_class("timeslice")
    trainer = h.build_trainer(cls, h.trainer_config(tmp_path, trigger=1), steps=4, fail_sync_at=2)
    with pytest.raises(RuntimeError, match="NCCL"):
        run(trainer)
    crashes = [r for r in events(tmp_path / "events.jsonl") if r["hook"] == "trainer_exception"]
    assert [(c["point"], c["error_type"]) for c in crashes] == [("update_weights", "RuntimeError")]


def test_adapter_choice():
    assert choose_adapter("auto", registry=False, is_hooked_trainer=False) == "stock"
    assert choose_adapter("auto", registry=True, is_hooked_trainer=True) == "hooked"
    assert choose_adapter("fork", registry=True, is_hooked_trainer=True) == "hooked"  # the former name
    assert choose_adapter("auto", registry=True, is_hooked_trainer=False) == "stock"
    assert choose_adapter("stock", registry=True, is_hooked_trainer=True) == "stock"
    with pytest.raises(ConfigError, match="register_trainer"):
        choose_adapter("fork", registry=False, is_hooked_trainer=False)
    with pytest.raises(ConfigError, match="trainer_name=timeslice"):
        choose_adapter("fork", registry=True, is_hooked_trainer=False)


def test_mismatched_job_tag_is_a_clear_error(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("TIMESLICE_JOB", "someone-else")
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, h.trainer_config(tmp_path, trigger=1), steps=1)
    with pytest.raises(ConfigError, match="TIMESLICE_JOB=adapter-test"):
        asyncio.run(trainer.init_workers())


def test_events_fire_inside_a_real_ray_actor(ray_local, tmp_path):
    """Created with .remote() as fully_async_main does: the wrapping survives actor pickling because
    the worker process's own `import verl` loads our entry point and wraps the class there."""
    cfg = h.trainer_config(tmp_path, trigger=1)
    trainer = verl_trainer_module.FullyAsyncTrainer.remote(
        config=cfg,
        tokenizer=None,
        role_worker_mapping={h.Role.Actor: h.FakeActorWorker},
        resource_pool_manager=h.FakeResourcePoolManager(),
        ray_worker_group_cls=h.FakeWorkerGroup,
        device_name="cpu",
    )
    rollouter = h.FakeRollouter.remote()

    def wire(self, rollouter, steps):
        self.rollouter = rollouter
        self.checkpoint_manager = h.FakeCheckpointManager([])
        self.set_message_queue_client(h.FakeMessageQueueClient(self.required_samples * steps))
        self.set_total_train_steps(steps)
        return os.getpid()

    actor_pid = ray.get(trainer.__ray_call__.remote(wire, rollouter, 3))
    assert actor_pid != os.getpid()
    ray.get(trainer.init_workers.remote())
    ray.get(trainer._fit_update_weights.remote())
    ray.get(trainer.fit.remote())

    def inspect_actor(self):
        from timeslice_verl.adapters import stock as actor_stock

        return actor_stock.is_installed(type(self)), self.__dict__["_timeslice_lifecycle"].adapter

    installed, adapter = ray.get(trainer.__ray_call__.remote(inspect_actor))
    assert installed and adapter == "stock"
    hooks = [r["hook"] for r in events(tmp_path / "events.jsonl")]
    assert hooks[:5] == ["timeslice_start", "init_workers_begin", "init_workers_end", "weight_sync_begin", "weight_sync_end"]
    assert hooks.count("pre_train_step") == 3 and hooks[-1] == "timeslice_stop"
    ray.kill(trainer)


def test_the_end_of_each_weight_sync_says_what_the_engine_pushed(ray_local, tmp_path):
    """Fully-async verl drops the metrics its checkpoint manager returns; the end of the sync carries the engine's
    bytes and seconds, and the manager is unwrapped again after each sync."""
    cfg = h.trainer_config(tmp_path, trigger=1)
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, cfg, steps=3)
    run(trainer)
    ends = [r for r in events(tmp_path / "events.jsonl") if r["hook"] == "weight_sync_end"]
    assert [(r["param_version"], r["pushed_bytes"], r["push_s"]) for r in ends] == [
        (v, (v + 1) * 10**6, (v + 1) / 1000) for v in range(4)]
    assert "update_weights" not in vars(trainer.checkpoint_manager)


@pytest.mark.parametrize("metrics, expected", [
    ({"timeslice_ipc/bytes": 2.0e9, "timeslice_ipc/seconds": 0.25, "timeslice_ipc/buckets": 4.0},
     Transfer(pushed_bytes=2_000_000_000, push_s=0.25)),
    ({}, None),  # verl's built-in engines report nothing
    (None, None),  # verl's manager returns None for its naive backend's early return
    ({"timeslice_ipc/bytes": 1.0}, None),  # half a report is none
    ({"timeslice_ipc/bytes": "1", "timeslice_ipc/seconds": 0.1}, None),
])
def test_transfer_is_read_from_the_engines_metrics_only(metrics, expected):
    assert transfer_of(metrics) == expected


def test_a_manager_already_wrapped_or_absent_is_left_alone():
    class Manager:
        async def update_weights(self):
            return {}

    class Trainer:
        checkpoint_manager = None

    with captured_transfer(Trainer()) as seen:
        assert seen == []
    trainer = Trainer()
    trainer.checkpoint_manager = Manager()
    mine = trainer.checkpoint_manager.update_weights = lambda: {}
    with captured_transfer(trainer):
        assert trainer.checkpoint_manager.update_weights is mine
    assert trainer.checkpoint_manager.update_weights is mine
