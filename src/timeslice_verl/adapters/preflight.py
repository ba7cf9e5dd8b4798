"""Checks of a verl run's whole config, in the launching process, before Ray starts anything.

The ``timeslice`` section validates itself at composition (the structured schema); what depends on
verl's own keys is checked here, when verl's ``run_ppo`` is called, so a config the agent cannot
serve fails in the user's terminal instead of inside a Ray actor minutes later.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import Any

from omegaconf import OmegaConf

from timeslice_verl.config.schema import JOB_TAG_ENV, ConfigError, TimesliceSettings, enabled_settings
from timeslice_verl.weights_ipc.one_gpu import prepare_one_gpu

BUNDLED_AGENT = "agent"
JOB_TAG_KEY = f"ray_kwargs.ray_init.runtime_env.env_vars.{JOB_TAG_ENV}"

# verl features that run the trainer's GPUs between its release at weight_sync_end and the next
# pre_train_step: a frozen (CUDA-locked) worker would hang there instead of failing.
GPU_USE_WHILE_RELEASED = {
    "async_training.use_trainer_do_validate": "validation on the trainer's GPUs",
    "async_training.use_dynamic_resource_scheduling": "verl's own rollout on the trainer's GPUs while it waits",
}


PROFILER_STEPS = "global_profiler.steps"
"""verl profiles its workers on these steps: with time-slicing the profiler would run while the GPU is lent."""


def _select(config: Any, key: str) -> Any:
    try:
        return OmegaConf.select(config, key, default=None)
    except Exception:  # a plain dict, or a key whose interpolation fails: nothing to check
        return None


def check_v1(config: Any, settings: TimesliceSettings) -> None:
    """What verl's v1 trainer must look like for time-slicing (raises :class:`ConfigError`)."""
    if settings.adapter not in ("auto", "v1"):
        raise ConfigError("timeslice.adapter", f"is {settings.adapter!r}, but this run uses verl's v1 trainer: "
                          "use 'auto' or 'v1'")
    mode = _select(config, "trainer.v1.trainer_mode")
    if mode != "separate_async":
        raise ConfigError("trainer.v1.trainer_mode", f"is {mode!r}: time-slicing serves the v1 'separate_async' "
                          "trainer (its GPUs wait for a standalone rollout); the other modes roll out on the "
                          "trainer's own GPUs")
    if BUNDLED_AGENT in settings.plugins.disabled:
        return  # observe-only: verl's own use of the GPUs is no conflict
    switch = bool(_select(config, "trainer.v1.separate_async.hybrid_rollout.enable_switch"))
    if _select(config, "actor_rollout_ref.hybrid_engine") is not False:
        raise ConfigError(
            "actor_rollout_ref.hybrid_engine",
            "is true: verl's hybrid rollout replicas share the trainer's GPUs"
            + (" and trainer.v1.separate_async.hybrid_rollout.enable_switch lends them to verl's own rollout"
               if switch else " (validation and the first step run on them)")
            + ", while time-slicing lends those GPUs to the batch tenant. Set actor_rollout_ref.hybrid_engine=False "
            "(rollout then runs on the standalone replicas only), or use +timeslice=observe",
        )


def check_hooked(settings: TimesliceSettings, module: ModuleType | None = None) -> None:
    """``timeslice.adapter=hooked`` needs a verl build whose fully-async trainer has lifecycle hooks and a trainer
    registry: on stock verl no event would ever fire (``module``: verl's trainer module; default: imported here)."""
    if str(settings.adapter) not in ("hooked", "fork"):
        return
    from timeslice_verl.adapters import TRAINER_MODULE
    from timeslice_verl.adapters.hooked import missing_hooks

    missing = missing_hooks(module if module is not None else importlib.import_module(TRAINER_MODULE))
    if missing:
        raise ConfigError("timeslice.adapter", f"is 'hooked', but the installed verl ({_verl_version()}) has no "
                          f"fully-async lifecycle hooks ({TRAINER_MODULE} lacks {', '.join(missing)}): the hooked "
                          "adapter needs a verl build with them. Use timeslice.adapter=auto (or stock) with this verl")


def _verl_version() -> str:
    try:
        return f"verl {importlib.metadata.version('verl')}"
    except importlib.metadata.PackageNotFoundError:
        return "verl, version unknown"


def _is_v1_runner(runner: Any) -> bool:
    cls = getattr(runner, "__ray_actor_class__", runner)
    return getattr(cls, "__name__", "") == "TaskRunnerV1"


def preflight(config: Any, *, v1: bool = False) -> None:
    """Raise :class:`ConfigError` naming the key when time-slicing cannot serve this verl config."""
    prepare_one_gpu(config)  # the one-GPU engine's keys and Ray's view of the GPU, whether time-slicing is on or not
    settings = enabled_settings(config)
    if settings is None:
        return
    if v1:
        check_v1(config, settings)
    elif settings.adapter == "v1":
        raise ConfigError("timeslice.adapter", "is 'v1' but this is not verl's v1 trainer (python -m "
                          "verl.trainer.main_ppo trainer.use_v1=True trainer.v1.trainer_mode=separate_async)")
    else:
        check_hooked(settings)
    if BUNDLED_AGENT in settings.plugins.disabled:
        return  # observe-only: the GPU is never handed over
    steps = _select(config, PROFILER_STEPS)
    if steps:
        raise ConfigError(PROFILER_STEPS, f"is {_plain(steps)}: verl profiles the trainer's workers on those steps, "
                          "while time-slicing may have lent their GPU to the batch tenant (the workers frozen). Set "
                          f"{PROFILER_STEPS}=null with time-slicing, or use +timeslice=observe to only record the "
                          "timeline")
    tag = _select(config, JOB_TAG_KEY)
    if tag is not None and str(tag) != settings.job:
        raise ConfigError("timeslice.job", f"is {settings.job!r} but {JOB_TAG_KEY} is {tag!r}: the agent finds the "
                          f"job's GPU processes by that tag, so rename the job in both places "
                          f"(timeslice.job={settings.job} {JOB_TAG_KEY}={settings.job})")
    for key, what in GPU_USE_WHILE_RELEASED.items():
        if _select(config, key):
            raise ConfigError(
                key,
                f"is true: {what} uses the GPU after the trainer released it to the batch tenant. Turn it off "
                "with time-slicing, or use +timeslice=observe to only record the timeline",
            )


def _plain(value: Any) -> Any:
    """A config value as the user wrote it (a list, not a ListConfig)."""
    try:
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    except Exception:
        return value


def wrap_run_ppo(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of ``verl.trainer.main_ppo.run_ppo``: preflight, then verl. A refused config
    ends the launcher with the message alone (a user's mistake, not a crash: no traceback)."""
    config = kwargs.get("config", args[0] if args else None)
    runner = kwargs.get("task_runner_class", args[1] if len(args) > 1 else None)
    try:
        preflight(config, v1=_is_v1_runner(runner))
    except ConfigError as exc:
        raise ConfigRefused(f"timeslice refused this config before starting verl: {exc}") from None
    return wrapped(*args, **kwargs)


class ConfigRefused(SystemExit):
    """Exit status 1 with the reason on stderr (``SystemExit`` passes through Hydra's error reporting)."""
