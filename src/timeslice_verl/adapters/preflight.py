"""Checks of a verl run's whole config, in the launching process, before Ray starts anything.

The ``timeslice`` section validates itself at composition (the structured schema); what depends on
verl's own keys is checked here, when verl's ``run_ppo`` is called, so a config the agent cannot
serve fails in the user's terminal instead of inside a Ray actor minutes later.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from timeslice_verl.config import ConfigError, enabled_settings

BUNDLED_AGENT = "agent"

# verl features that run the trainer's GPUs between its release at weight_sync_end and the next
# pre_train_step: a frozen (CUDA-locked) worker would hang there instead of failing.
GPU_USE_WHILE_RELEASED = {
    "async_training.use_trainer_do_validate": "validation on the trainer's GPUs",
    "async_training.use_dynamic_resource_scheduling": "verl's own rollout on the trainer's GPUs while it waits",
}


def _select(config: Any, key: str) -> Any:
    try:
        return OmegaConf.select(config, key, default=None)
    except Exception:  # a plain dict, or a key whose interpolation fails: nothing to check
        return None


def preflight(config: Any) -> None:
    """Raise :class:`ConfigError` naming the key when time-slicing cannot serve this verl config."""
    settings = enabled_settings(config)
    if settings is None or BUNDLED_AGENT in settings.plugins.disabled:
        return  # off, or observe-only: the GPU is never handed over
    for key, what in GPU_USE_WHILE_RELEASED.items():
        if _select(config, key):
            raise ConfigError(
                key,
                f"is true: {what} uses the GPU after the trainer released it to the batch tenant. Turn it off "
                "with time-slicing, or use +timeslice=observe to only record the timeline",
            )


def wrap_run_ppo(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of ``verl.trainer.main_ppo.run_ppo``: preflight, then verl."""
    config = kwargs.get("config", args[0] if args else None)
    preflight(config)
    return wrapped(*args, **kwargs)
