"""The launcher's check of a one-GPU run (engine ``timeslice_ipc``), before Ray starts (no torch, no verl).

Whenever verl's config selects the engine, the keys that put the trainer's and the rollout's pools on one GPU must
hold their values (:data:`ONE_GPU_KEYS`, set by ``+timeslice=one_gpu``): a changed one is refused by name. What
lives outside the config is set here, in the launching process, because Ray reads it when it starts:
``CUDA_VISIBLE_DEVICES`` (one GPU listed twice) and ``ray_kwargs.ray_init.num_cpus`` (when null).
"""

from __future__ import annotations

import os
import sys
from typing import Any, MutableMapping

from omegaconf import OmegaConf, open_dict

from timeslice_verl.config.checks import ConfigError
from timeslice_verl.log import get_logger
from timeslice_verl.weights_ipc import BACKEND, ENGINE_MODULE

log = get_logger("weights_ipc")

BACKEND_KEY = "actor_rollout_ref.rollout.checkpoint_engine.backend"
ONE_GPU_KEYS: dict[str, Any] = {
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": ENGINE_MODULE,
    "actor_rollout_ref.hybrid_engine": False,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 1,
    "rollout.nnodes": 1,
    "rollout.n_gpus_per_node": 1,
    "ray_kwargs.ray_init.num_gpus": 2,
}
"""What a one-GPU run needs besides ``checkpoint_engine.backend=timeslice_ipc`` (the option sets them all)."""
WHY = {
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": "verl imports it to find the engine",
    "actor_rollout_ref.hybrid_engine": "the rollout must be a standalone replica beside the trainer",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "verl builds zero rollout replicas on one GPU otherwise",
    "trainer.nnodes": "the trainer's pool is the one GPU",
    "trainer.n_gpus_per_node": "the trainer's pool is the one GPU",
    "rollout.nnodes": "the rollout's pool is the same GPU",
    "rollout.n_gpus_per_node": "the rollout's pool is the same GPU",
    "ray_kwargs.ray_init.num_gpus": "Ray offers the one GPU twice, once to each pool",
}
VISIBLE = "CUDA_VISIBLE_DEVICES"


def _select(config: Any, key: str) -> Any:
    try:
        return OmegaConf.select(config, key, default=None)
    except Exception:  # a plain dict, or an interpolation that fails: not ours to judge
        return None


def uses_engine(config: Any) -> bool:
    return str(_select(config, BACKEND_KEY)) == BACKEND


def one_gpu_visible(value: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for Ray: the one GPU listed twice (unset → ``0,0``; ``N`` → ``N,N``)."""
    entries = [e.strip() for e in (value or "").split(",") if e.strip()]
    if not entries:
        return "0,0"
    if len(set(entries)) == 1 and len(entries) <= 2:
        return f"{entries[0]},{entries[0]}"
    raise ConfigError(VISIBLE, f"is {value!r}: with checkpoint_engine.backend={BACKEND} the trainer and the rollout "
                      "share ONE GPU, so list it twice (CUDA_VISIBLE_DEVICES=N,N), or leave it unset for GPU 0")


def check_keys(config: Any) -> None:
    """Refuse, by key, a config that selects the engine but changed a key of :data:`ONE_GPU_KEYS`."""
    for key, want in ONE_GPU_KEYS.items():
        have = _select(config, key)
        if have != want:
            raise ConfigError(key, f"is {have!r}, but checkpoint_engine.backend={BACKEND} (one GPU) needs {want!r}: "
                              f"{WHY[key]}. Use +timeslice=one_gpu without changing it, or another checkpoint engine")


def prepare_one_gpu(config: Any, environ: MutableMapping[str, str] | None = None) -> None:
    """In the launcher, before Ray starts: check the keys, then set ``CUDA_VISIBLE_DEVICES`` and ``num_cpus``."""
    if not uses_engine(config):
        return
    check_keys(config)
    env = os.environ if environ is None else environ
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        log.warning("Ray was started before this check: it must see one GPU twice (%s=N,N, num_gpus=2)", VISIBLE)
        return
    visible = one_gpu_visible(env.get(VISIBLE))
    if env.get(VISIBLE) != visible:
        log.warning("one GPU for trainer and rollout: %s=%s (was %r) for Ray", VISIBLE, visible, env.get(VISIBLE))
        env[VISIBLE] = visible
    if _select(config, "ray_kwargs.ray_init.num_cpus") is None:
        cpus = len(os.sched_getaffinity(0))
        with open_dict(config):
            config.ray_kwargs.ray_init.num_cpus = cpus
        log.warning("one GPU for trainer and rollout: ray_kwargs.ray_init.num_cpus=%d (this process's CPUs)", cpus)


__all__ = ["BACKEND_KEY", "ONE_GPU_KEYS", "check_keys", "one_gpu_visible", "prepare_one_gpu", "uses_engine"]
