"""What the adapters share: the per-trainer Lifecycle, adapter choice, and events read off verl."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from timeslice_verl.adapters import TRAINER_MODULE
from timeslice_verl.adapters.workers import VerlRanks
from timeslice_verl.config.schema import JOB_TAG_ENV, ConfigError, TimesliceSettings, enabled_settings
from timeslice_verl.hooks.events import RolloutEvent, TrainStepEvent
from timeslice_verl.hooks.lifecycle import Lifecycle
from timeslice_verl.log import get_logger

log = get_logger("adapter")

_ATTR = "_timeslice_lifecycle"
_INERT = object()
_announced: set[tuple[int, str]] = set()
_lock = threading.Lock()

HOOKED_MARKER = "__timeslice_hooked_trainer__"
"""Class attribute set on the trainer class the hooked adapter registers."""
V1_MARKER = "__timeslice_v1_trainer__"
"""Class attribute set on the v1 trainer subclass the v1 adapter registers."""
_V1_VERSION_ATTR = "_timeslice_param_version"


def choose_adapter(setting: str, *, registry: bool, is_hooked_trainer: bool, is_v1_trainer: bool = False) -> str:
    """Which adapter fires for this trainer: ``v1``, ``hooked`` or ``stock`` (``timeslice.adapter``)."""
    if is_v1_trainer:
        if setting not in ("auto", "v1"):
            raise ConfigError("timeslice.adapter", f"is {setting!r}, but this run uses verl's v1 trainer: use 'auto' or 'v1'")
        return "v1"
    if setting == "v1":
        raise ConfigError("timeslice.adapter", "is 'v1' but this trainer is not verl's v1 separate_async trainer")
    if setting == "stock":
        return "stock"
    if setting == "fork":  # the former name
        log.warning("timeslice.adapter=fork is now called 'hooked'")
        setting = "hooked"
    if setting == "hooked":
        if not registry:
            raise ConfigError(
                "timeslice.adapter",
                "'hooked' needs a verl with fully-async lifecycle hooks and a trainer registry "
                "(register_trainer); this verl has none: use 'stock' or 'auto'",
            )
        if not is_hooked_trainer:
            raise ConfigError(
                "timeslice.adapter",
                "'hooked' is set but the running trainer is not the one timeslice registered: "
                "set async_training.trainer_name=timeslice (the interleave option does)",
            )
        return "hooked"
    return "hooked" if (registry and is_hooked_trainer) else "stock"


def _registry_available(trainer: Any) -> bool:
    """verl's trainer module (or the trainer's own) has a trainer registry (``register_trainer``)."""
    modules = (sys.modules.get(type(trainer).__module__), sys.modules.get(TRAINER_MODULE))
    return any(callable(getattr(m, "register_trainer", None)) for m in modules if m is not None)


def lifecycle_for(trainer: Any, adapter: str) -> Lifecycle | None:
    """The trainer's Lifecycle if ``adapter`` is the one that fires for it, else None (inert).

    Built on first use inside the process that runs the trainer (a Ray actor), cached on the
    instance, never pickled. A trainer without an enabled ``timeslice`` section is inert.
    """
    cached = trainer.__dict__.get(_ATTR)
    if cached is _INERT:
        return None
    if cached is None:
        with _lock:
            cached = trainer.__dict__.get(_ATTR)
            if cached is None:
                cached = _bind(trainer)
                trainer.__dict__[_ATTR] = cached
    if cached is _INERT or cached.adapter != adapter:
        return None
    return cached


def _bind(trainer: Any) -> Lifecycle | object:
    settings = enabled_settings(getattr(trainer, "config", None))
    if settings is None:
        return _INERT
    is_v1 = bool(getattr(type(trainer), V1_MARKER, False))
    chosen = choose_adapter(
        settings.adapter,
        registry=_registry_available(trainer),
        is_hooked_trainer=bool(getattr(type(trainer), HOOKED_MARKER, False)),
        is_v1_trainer=is_v1,
    )
    _check_job_tag(settings)
    key = (os.getpid(), chosen)
    if key not in _announced:
        _announced.add(key)
        log.info("timeslice: %s adapter fires lifecycle events for job %s (pid %d)", chosen, settings.job, os.getpid())
    extra = {"progress": v1_progress} if is_v1 else {}  # fully-async: the dispatcher's default (param versions)
    backlog = (lambda: v1_backlog(trainer)) if is_v1 else (lambda: fully_async_backlog(trainer))
    return Lifecycle.build(settings, trainer=trainer, adapter=chosen, ranks=VerlRanks(trainer), backlog=backlog,
                           **extra)


def fully_async_backlog(trainer: Any) -> tuple[int, int] | None:
    """(samples toward the next step, samples a step takes) of verl's fully-async trainer; None before the
    queue exists. The trainer takes samples off the queue one at a time as they come, so those it already holds
    for the batch it is collecting count too (the queue alone read "none" through the whole valley): every batch
    takes ``required`` samples, so they are the queue's consumed count modulo ``required``."""
    client = getattr(trainer, "message_queue_client", None)
    required = int(getattr(trainer, "required_samples", 0) or 0)
    if client is None or not required:
        return None
    stats = client.get_statistics_sync()
    return int(stats["queue_size"]) + int(stats["total_consumed"]) % required, required


def v1_backlog(trainer: Any) -> tuple[int, int] | None:
    """(sampleable groups for the next step, groups a mini-batch takes) of verl's v1 ``separate_async``
    trainer, counted as verl's own switch decision counts them."""
    buffer = getattr(trainer, "replay_buffer", None)
    if buffer is None or not hasattr(buffer, "get_sampleable_count"):
        return None
    required = int(trainer.config.data.train_batch_size) // max(1, int(getattr(trainer, "parameter_sync_step", 1) or 1))
    return int(buffer.get_sampleable_count(int(getattr(trainer, "global_steps", 0) or 0) + 1, "train")), required


def _check_job_tag(settings: TimesliceSettings) -> None:
    tag = os.environ.get(JOB_TAG_ENV)
    if tag is not None and tag != settings.job:
        raise ConfigError(
            "timeslice.job",
            f"is {settings.job!r} but this process is tagged {JOB_TAG_ENV}={tag!r}; set "
            f"ray_kwargs.ray_init.runtime_env.env_vars.{JOB_TAG_ENV}={settings.job} too (the agent finds "
            "the job's GPU processes by that tag)",
        )


def v1_progress(trainer: Any) -> tuple[int, int]:
    """(step, param version): v1 counts weight pushes itself; the v1 adapter counts them as they happen."""
    return int(getattr(trainer, "global_steps", 0) or 0), int(trainer.__dict__.get(_V1_VERSION_ATTR, 0))


def rollout_event(lc: Lifecycle, trainer: Any, batch: Any = None) -> RolloutEvent:
    """post-rollout, read off the trainer (and the assembled batch when the seam has it)."""
    required = int(getattr(trainer, "required_samples", 0) or 0)
    waits = getattr(trainer, "_step_wait_times", None) or []
    wait = float(waits[-1]) if waits else 0.0
    if not waits and batch is not None:
        wait = float(getattr(batch, "meta_info", {}).get("fully_async/total_wait_time", 0.0))
    return lc.event(RolloutEvent, samples=required, required_samples=required, queue_wait_s=round(wait, 6))


def train_step_event(lc: Lifecycle, trainer: Any) -> TrainStepEvent:
    return lc.event(
        TrainStepEvent,
        local_step=int(getattr(trainer, "local_trigger_step", 1) or 1),
        samples=int(getattr(trainer, "required_samples", 0) or 0),
    )


def save_due(trainer: Any) -> bool:
    """Whether verl's ``_fit_save_checkpoint`` will save at the trainer's current param version.

    Mirrors verl 0.9's rule (``save_freq > 0`` and the version a multiple of it, once per version);
    the ESI-expiry save cannot be foreseen and is covered by ``save_checkpoint_begin`` acquiring.
    """
    config = getattr(trainer, "config", None)
    try:
        save_freq = int(config.trainer.save_freq)
    except (AttributeError, TypeError, ValueError):
        return False
    version = int(getattr(trainer, "current_param_version", 0) or 0)
    if save_freq <= 0 or version == getattr(trainer, "last_ckpt_version", None):
        return False
    return version % save_freq == 0


def in_fit(trainer: Any) -> bool:
    return bool(trainer.__dict__.get("_timeslice_in_fit", False))


def set_in_fit(trainer: Any, value: bool) -> None:
    trainer.__dict__["_timeslice_in_fit"] = value
