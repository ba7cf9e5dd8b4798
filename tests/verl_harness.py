"""Drive verl's real ``FullyAsyncTrainer`` on CPU, its GPU work replaced at the boundaries.

What is fake, and only that: the worker group class (``ray_worker_group_cls``: spawns no GPU
actors; ``update_actor`` returns metrics, ``save_checkpoint`` records), the resource pool manager,
the message queue client (serves pickled ``RolloutSample`` objects built here, then the ``None``
termination signal), the rollouter (a tiny real Ray actor with the methods the trainer calls) and
the checkpoint-engine manager (records weight pushes). Everything between — ``fit``, ``fit_step``,
batch assembly, reward extraction, bypass-mode log probs, GRPO advantages, metrics, the sync and
save logic — is verl's own code.
"""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from tensordict import TensorDict

from verl import DataProto
from verl.experimental.fully_async_policy.detach_utils import RolloutSample
from verl.single_controller.base import Worker
from verl.trainer.ppo.utils import Role
from verl.utils import tensordict_utils as tu

PROMPT_LEN = 4
RESPONSE_LEN = 4
N = 2  # responses per prompt (actor_rollout_ref.rollout.n)


def verl_config_dir() -> Path:
    spec = importlib.util.find_spec("verl")
    assert spec and spec.origin
    return Path(spec.origin).parent / "experimental" / "fully_async_policy" / "config"


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        cfg = hydra_compose(config_name="fully_async_ppo_trainer", overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg


def trainer_config(tmp: Path, *, trigger: int, timeslice: bool = True, extra: list[str] = ()):
    overrides = [
        f"async_training.trigger_parameter_sync_step={trigger}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "trainer.balance_batch=false",
        "trainer.logger=[console]",
        "trainer.test_freq=-1", "trainer.val_before_train=False",
        "trainer.save_freq=-1",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "rollout.n_gpus_per_node=1",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        "trainer.project_name=timeslice-test",
        "trainer.experiment_name=adapter",
    ]
    if timeslice:
        overrides += [
            "+timeslice=interleave",
            "timeslice.job=adapter-test",
            "timeslice.plugins.disabled=[agent,metrics]",
            "timeslice.plugins.enabled=[]",  # load only the plugins this test names
            f"timeslice.timeline.path={tmp / 'events.jsonl'}",
        ]
    if timeslice:
        # the option tags workers through runtime_env; a test process is not tagged
        overrides.append("ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_JOB=adapter-test")
    return compose(overrides + list(extra))


# --------------------------------------------------------------------------- fakes at the boundaries


@ray.remote
class FakeActorWorker(Worker):
    """Stands for the FSDP actor worker class in ``role_worker_mapping``; never instantiated."""


class FakeResourcePool:
    world_size = 1


class FakeResourcePoolManager:
    def __init__(self) -> None:
        self.resource_pool_dict: dict[str, Any] = {}

    def create_resource_pool(self) -> None:
        self.resource_pool_dict = {"global_pool": FakeResourcePool()}

    def get_resource_pool(self, role: Any) -> Any:
        return self.resource_pool_dict["global_pool"]

    def get_n_gpus(self) -> int:
        return 1


class FakeActorGroup:
    """The actor worker group: what touches the GPU in a real run."""

    world_size = 1

    def __init__(self, log: list) -> None:
        self.log = log

    def init_model(self) -> None:
        self.log.append(("init_model",))

    def update_actor(self, batch_td: TensorDict) -> TensorDict:
        self.log.append(("update_actor", int(batch_td.batch_size[0]) if batch_td.batch_size else 0))
        out = TensorDict({}, batch_size=[])
        tu.assign_non_tensor(out, metrics={"pg_loss": [0.1], "mfu": [0.0], "grad_norm": [1.0]})
        return out

    def save_checkpoint(self, local_path, remote_path, version, max_ckpt_to_keep=None) -> None:
        Path(local_path).mkdir(parents=True, exist_ok=True)  # the real worker writes shards here
        self.log.append(("save_checkpoint", version))


class FakeWorkerGroup:
    """``ray_worker_group_cls``: would spawn Ray actors on GPUs; here it hands out FakeActorGroups."""

    log: list = []

    def __init__(self, resource_pool: Any, ray_cls_with_init: Any, **kwargs: Any) -> None:
        self.ray_cls_with_init = ray_cls_with_init

    def spawn(self, prefix_set) -> dict:
        return {prefix: FakeActorGroup(FakeWorkerGroup.log) for prefix in prefix_set}


class FakeCheckpointManager:
    """verl's manager returns the sending engine's metrics: these, as ``timeslice_ipc`` reports them (version N
    pushes N+1 MB in N+1 ms)."""

    def __init__(self, log: list, fail_at: int | None = None) -> None:
        self.log = log
        self.fail_at = fail_at

    async def update_weights(self, global_steps: int) -> dict:
        from timeslice_verl.weights_ipc import METRIC_BUCKETS, METRIC_BYTES, METRIC_SECONDS

        if self.fail_at is not None and global_steps >= self.fail_at:
            raise RuntimeError(f"NCCL broadcast failed at version {global_steps}")
        self.log.append(("update_weights", global_steps))
        return {METRIC_BYTES: float((global_steps + 1) * 10**6), METRIC_SECONDS: (global_steps + 1) / 1000,
                METRIC_BUCKETS: 1.0}


@ray.remote(num_cpus=0)
class FakeRollouter:
    def __init__(self) -> None:
        self.produced = 0
        self.saved: list[str] = []

    def get_total_produced_samples(self) -> int:
        return self.produced

    def get_completed_steps(self) -> int:
        return 0

    def reset_staleness(self) -> dict:
        return {"fully_async/rollouter/staleness_reset": 1.0}

    def save_checkpoint(self, folder: str) -> None:
        self.saved.append(folder)

    def get_saved(self) -> list[str]:
        return self.saved


def rollout_sample(version: int) -> bytes:
    """One queue item: a prompt with N responses, reward and rollout log probs, as the rollouter sends."""
    seq = PROMPT_LEN + RESPONSE_LEN
    prompts = torch.randint(3, 100, (N, PROMPT_LEN))
    responses = torch.randint(3, 100, (N, RESPONSE_LEN))
    rm_scores = torch.zeros(N, RESPONSE_LEN)
    rm_scores[:, -1] = torch.rand(N)
    full = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.ones(N, seq, dtype=torch.long),
            "position_ids": torch.arange(seq).repeat(N, 1),
            "rollout_log_probs": -torch.rand(N, RESPONSE_LEN),
            "rm_scores": rm_scores,
        },
        non_tensors={
            "uid": np.array([str(uuid.uuid4())] * N, dtype=object),
            "min_global_steps": np.array([version] * N, dtype=object),
            "max_global_steps": np.array([version] * N, dtype=object),
        },
        meta_info={"metrics": [{"generate_sequences": 0.05, "tool_calls": 0.0} for _ in range(N)]},
    )
    sample = RolloutSample(full_batch=full, sample_id=str(uuid.uuid4()), epoch=0, rollout_status={"queue": 1})
    return ray.cloudpickle.dumps(sample)


class FakeMessageQueueClient:
    """Serves ``samples`` items, then the None termination signal (as the rollouter's end does)."""

    def __init__(self, samples: int, wait_s: float = 0.0) -> None:
        self.remaining = samples
        self.wait_s = wait_s
        self.served = 0

    async def get_sample(self):
        if self.remaining <= 0:
            return None, 0
        if self.wait_s:
            await asyncio.sleep(self.wait_s)
        self.remaining -= 1
        self.served += 1
        return rollout_sample(0), self.remaining

    async def get_queue_size(self) -> int:
        return self.remaining

    def get_queue_size_sync(self) -> int:
        return self.remaining

    def get_statistics_sync(self) -> dict[str, int]:
        return {"queue_size": self.remaining, "total_consumed": self.served}


def build_trainer(trainer_cls: Any, config, *, steps: int, fail_sync_at: int | None = None, wait_s: float = 0.0):
    """A FullyAsyncTrainer wired to the fakes, ready for ``init_workers`` (as fully_async_main wires it)."""
    FakeWorkerGroup.log = []
    cls = getattr(trainer_cls, "__ray_actor_class__", trainer_cls)
    trainer = cls(
        config=config,
        tokenizer=None,
        role_worker_mapping={Role.Actor: FakeActorWorker},
        resource_pool_manager=FakeResourcePoolManager(),
        ray_worker_group_cls=FakeWorkerGroup,
        device_name="cpu",
    )
    required = trainer.required_samples
    trainer.rollouter = FakeRollouter.remote()
    trainer.checkpoint_manager = FakeCheckpointManager(FakeWorkerGroup.log, fail_at=fail_sync_at)
    trainer.set_message_queue_client(FakeMessageQueueClient(required * steps, wait_s=wait_s))
    trainer.set_total_train_steps(steps)
    return trainer


async def run_like_fully_async_main(trainer) -> None:
    """What ``FullyAsyncTaskRunner`` calls on the trainer, in its order: init, pre-fit sync, validation before
    training (when the config asks), fit."""
    await trainer.init_workers()
    await trainer._fit_update_weights()
    if trainer.config.trainer.get("val_before_train", True):
        await trainer._fit_validate(True)
    await trainer.fit()
