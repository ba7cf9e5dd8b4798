"""verl 0.9's v1 ``separate_async`` trainer on CPU, faked only where it meets the world.

Real: the trainer class (the adapter's subclass of verl's ``PPOTrainerSeparateAsync``), its
``__init__``, ``init``, ``fit``, ``step``, ``_step_once``, the ``on_*`` hooks, ``_update_actor``,
``_save_checkpoint``, the replay-buffer construction, the config (verl's own ``ppo_trainer.yaml``
composed with ``+timeslice=interleave``). Faked: the infrastructure ``PPOTrainer._setup`` builds
(Ray worker groups, rollout servers, reward workers, dataloader), the checkpoint-engine managers, the
TransferQueue data plane, the replay buffer's sampling, and the tensor math between sampling and the
actor update (old log-probs, advantages, metrics), which reads tensors the fakes do not produce.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from transfer_queue import KVBatchMeta

import verl
from timeslice_verl.config.overrides import register_schema

VERL_CONFIG = Path(verl.__file__).parent / "trainer" / "config"


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(VERL_CONFIG), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def v1_config(tmp: Path, *, sync_step: int, timeslice: bool = True, extra: list[str] = ()):
    mini = 2
    overrides = [
        "trainer.use_v1=True",
        "trainer.v1.trainer_mode=separate_async",
        f"trainer.v1.separate_async.parameter_sync_step={sync_step}",
        "trainer.v1.separate_async.num_warmup_batches=0",
        f"data.train_batch_size={mini * sync_step}",
        f"data.gen_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "actor_rollout_ref.model.path=/nonexistent/model",
        "algorithm.adv_estimator=grpo",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.device=cpu",
        "trainer.total_epochs=1",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        "trainer.project_name=timeslice-test",
        "trainer.experiment_name=v1",
    ]
    if timeslice:
        overrides += [
            "+timeslice=interleave",
            "timeslice.job=v1-test",
            "timeslice.plugins.disabled=[agent,metrics]",
            "timeslice.plugins.enabled=[]",
            f"timeslice.timeline.path={tmp / 'events.jsonl'}",
            "ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_JOB=v1-test",
        ]
    return compose(overrides + list(extra))


class FakeTQ:
    """The TransferQueue calls the real code paths make here, in memory."""

    def __init__(self) -> None:
        self.partitions: dict[str, dict[str, dict]] = {}
        self.cleared: list[str] = []

    def kv_list(self, partition_id: str) -> dict:
        return {partition_id: dict(self.partitions.get(partition_id, {}))} if self.partitions.get(partition_id) else {}

    def kv_batch_put(self, keys, partition_id, tags=None, fields=None):
        part = self.partitions.setdefault(partition_id, {})
        for i, key in enumerate(keys):
            part[key] = (tags or [{}] * len(keys))[i]

    def kv_clear(self, keys, partition_id):
        self.cleared.extend(keys)
        for key in keys:
            self.partitions.get(partition_id, {}).pop(key, None)

    def save_checkpoint(self, path, metadata=None):
        Path(path).mkdir(parents=True, exist_ok=True)


class FakeDataloader:
    def __init__(self, gen_batch_size: int) -> None:
        self.gen_batch_size = gen_batch_size

    def __iter__(self):
        while True:
            yield {"raw_prompt": np.array([f"q{i}" for i in range(self.gen_batch_size)], dtype=object)}

    def __len__(self) -> int:
        return 1000

    def state_dict(self) -> dict:
        return {}


class FakeAgentLoopManager:
    """Generation: every submitted prompt becomes a finished trajectory the replay buffer can hand out."""

    def __init__(self, buffer: FakeReplayBuffer) -> None:
        self.buffer = buffer

    def generate_sequences(self, batch) -> None:
        self.buffer.ready.extend(list(batch["uid"]))


class FakeReplayBuffer:
    def __init__(self, wait_s: float = 0.0) -> None:
        self.ready: list[str] = []
        self.wait_s = wait_s
        self.sampled: list[tuple[int, int]] = []

    sampleable: int | None = None
    """What ``get_sampleable_count`` answers instead of the groups generated so far (a rollout far ahead)."""

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        """verl's ``ReplayBuffer.get_sampleable_count``: the groups ready to sample."""
        return len(self.ready) if self.sampleable is None else self.sampleable

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        time.sleep(self.wait_s)  # the trainer's idle valley
        keys = [self.ready.pop(0) if self.ready else f"k{global_steps}-{i}" for i in range(batch_size)]
        self.sampled.append((global_steps, batch_size))
        return KVBatchMeta(partition_id=partition_id, keys=keys, tags=[{"seq_len": 8} for _ in keys]), {}


class FakeActorGroup:
    """The actor worker group: what touches the GPU in a real run."""

    def __init__(self, log: list, fail_update_at: int | None = None) -> None:
        self.log = log
        self.fail_update_at = fail_update_at
        self.updates = 0

    def update_actor(self, batch):
        self.updates += 1
        if self.fail_update_at == self.updates:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.log.append(("update_actor", len(batch)))
        return {"metrics": {"pg_loss": [0.1], "mfu": [0.0], "grad_norm": [1.0]}}

    def save_checkpoint(self, local_path, remote_path, step, max_ckpt_to_keep=None) -> None:
        Path(local_path).mkdir(parents=True, exist_ok=True)
        self.log.append(("save_checkpoint", step))


class FakeCheckpointManager:
    """Checkpoint-engine manager: the weight push from the trainer to the rollout replicas."""

    def __init__(self, log: list, **_: Any) -> None:
        self.log = log

    def update_weights(self, global_steps: int | None = None) -> dict:
        self.log.append(("update_weights", global_steps))
        return {}


class FakeServerManager:
    def __init__(self) -> None:
        self.rollout_replicas: list = []
        self.server_addresses: list = []

    @classmethod
    def create(cls, config: Any = None, start_rank: int = 0) -> FakeServerManager:
        return cls()

    def get_replicas(self) -> list:
        return []

    def get_client(self, client_cls: Any = None) -> str:
        return "llm-client"


class Fakes:
    """Installs the fakes on verl's modules (with pytest's monkeypatch) and on a trainer instance."""

    def __init__(self, monkeypatch, *, wait_s: float = 0.0, fail_update_at: int | None = None, steps: int = 3) -> None:
        from verl.trainer.ppo.v1 import trainer_base, trainer_separate_async

        self.log: list = []
        self.tq = FakeTQ()
        self.buffer = FakeReplayBuffer(wait_s)
        self.steps = steps
        self.actor = FakeActorGroup(self.log, fail_update_at)
        fakes = self

        def fake_setup(trainer) -> None:  # what PPOTrainer._setup builds: Ray workers, servers, data
            trainer.tokenizer = None
            trainer._init_dump_executor()  # verl's own, as its _setup does
            trainer.train_dataloader = FakeDataloader(int(trainer.config.data.gen_batch_size))
            trainer.train_dataloader_it = None
            trainer.total_training_steps = fakes.steps
            trainer.steps_per_epoch = fakes.steps
            trainer.global_steps = 0
            trainer.actor_rollout_wg = fakes.actor
            trainer.llm_server_manager = FakeServerManager()
            trainer.checkpoint_manager = FakeCheckpointManager(fakes.log)
            trainer.reward_loop_manager = type("RewardLoop", (), {"reward_loop_worker_handles": ["reward-worker"]})()
            trainer.replay_buffer = fakes.buffer
            fakes.log.append(("setup",))

        monkeypatch.setattr(trainer_base.PPOTrainer, "_setup", fake_setup)
        monkeypatch.setattr(trainer_base, "tq", self.tq)
        monkeypatch.setattr(trainer_separate_async, "LLMServerManager", FakeServerManager)
        monkeypatch.setattr(trainer_separate_async, "CheckpointEngineManager", lambda **kw: FakeCheckpointManager(fakes.log, **kw))

    def instrument(self, trainer) -> None:
        """The tensor math between sampling and the actor update, which needs real trajectories."""
        trainer._balance_batch = lambda batch, metrics, **kw: batch
        trainer._compute_old_log_prob = lambda batch, metrics: batch
        trainer._compute_advantage = lambda batch, metrics: batch
        trainer._compute_metrics = lambda batch, metrics, timing_raw, global_steps, epoch: None

    def agent_loop_manager(self) -> FakeAgentLoopManager:
        return FakeAgentLoopManager(self.buffer)


def build(config, fakes: Fakes):
    from verl.trainer.ppo.v1 import get_trainer_cls

    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)
    fakes.instrument(trainer)
    return trainer


def run(trainer, fakes: Fakes) -> None:
    """What verl's ``TaskRunnerV1.run`` does with the trainer: init, then fit."""
    trainer.init()
    trainer.fit(fakes.agent_loop_manager())
