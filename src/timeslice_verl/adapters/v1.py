"""v1 adapter: fire the lifecycle events from verl's v1 ``separate_async`` trainer through its own hooks.

verl 0.9's v1 trainer (``python -m verl.trainer.main_ppo trainer.use_v1=True
trainer.v1.trainer_mode=separate_async``) has a trainer registry and ``on_*`` template methods. This
adapter subclasses ``PPOTrainerSeparateAsync`` — overrides call ``super()`` first or last, never
replace verl's behaviour — and registers the subclass as ``timeslice`` and in place of
``separate_async`` (inert without an enabled ``timeslice`` section, so plain v1 runs are unchanged).

=============================  =========================================================
v1 phase                       events
=============================  =========================================================
``_setup`` (inside ``init``)   init_workers_begin / init_workers_end
``on_init_end``                weight_sync_begin / weight_sync_end (``initial``: the first push)
``on_sample_end``              post_rollout (the replay buffer handed over a mini-batch), then
                               pre_train_step (the trainer's GPU is used next)
``_save_checkpoint``           save_checkpoint_begin (may veto) / save_checkpoint_end
``on_step_end``                weight_sync_begin / weight_sync_end (the push to the rollout)
``_validate``                  with ``timeslice.validate.enable``: the step's weights to the policy tenant, not awaited
``fit``                        trainer_exception on error; timeslice_stop at the end
=============================  =========================================================

The trainer's GPU is idle while ``replay_buffer.sample`` waits (between ``on_sample_begin`` and
``on_sample_end``); the agent plugin releases it at ``weight_sync_end`` and takes it back at
``pre_train_step``. verl's own hybrid rollout replicas would use the same GPUs in that valley
(``actor_rollout_ref.hybrid_engine``, ``hybrid_rollout.enable_switch``), so the two are refused
together, before anything is built.
"""

from __future__ import annotations

import contextlib
import logging
import time
from types import ModuleType
from typing import Any, Iterator

from timeslice_verl.adapters.common import _V1_VERSION_ATTR, V1_MARKER, lifecycle_for
from timeslice_verl.adapters.plans import fit_plan, init_plan, run, sample_plan, save_plan, sync_plan
from timeslice_verl.adapters.preflight import check_v1
from timeslice_verl.config.schema import enabled_settings
from timeslice_verl.hooks.events import RolloutEvent, TrainStepEvent
from timeslice_verl.log import get_logger

log = get_logger("adapter.v1")

NAME = "v1"
TRAINER_NAME = "timeslice"


@contextlib.contextmanager
def _verl_091_setup_logging(module: ModuleType, trainer: Any) -> Iterator[None]:
    """verl 0.9.1's ``_setup`` logs with ``logger.info(..., flush=True)`` when hybrid replicas are off,
    which raises TypeError whenever INFO is enabled: the very setting time-slicing needs. Its INFO
    lines are skipped during that call (WARNING and above still show)."""
    logger = getattr(module, "logger", None)
    if logger is None or getattr(trainer, "_enable_hybrid_replicas", True) or not logger.isEnabledFor(logging.INFO):
        yield
        return
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _submit_validation(trainer: Any, lc: Any) -> dict[str, float]:
    """The step's version to the policy tenant, not awaited (verl validates before training, every ``test_freq`` and at
    the end, at this step); verl asserts a validation returned metrics: the submission is one."""
    from timeslice_verl.validate.setup import submit  # only where validation is on

    step = int(trainer.global_steps)
    return {"timeslice/validate/submitted": float(step) if submit(trainer, lc, step, force=True) else -1.0}


def _flush_validation(trainer: Any) -> None:
    """The validations that ended since the last step, logged on the trainer's thread (verl's tracker is not meant to
    be called from the validation's)."""
    lc = lifecycle_for(trainer, NAME)
    if lc is not None and lc.settings.validate.enable:
        from timeslice_verl.validate.setup import flush

        flush(trainer)


def _end_validation(trainer: Any, lc: Any) -> None:
    if lc.settings.validate.enable:
        from timeslice_verl.validate.setup import close_validator

        close_validator(trainer, lc.settings.validate.finish_s)


def build(module: ModuleType) -> type:
    """The timeslice subclass of the module's ``PPOTrainerSeparateAsync``."""
    base = module.PPOTrainerSeparateAsync

    class TimesliceSeparateAsync(base):  # type: ignore[misc, valid-type]
        """verl's ``separate_async`` trainer, telling timeslice's plugins what it does."""

        def __init__(self, config: Any) -> None:
            if (settings := enabled_settings(config)) is not None:
                check_v1(config, settings)  # before verl builds anything on the GPUs
            super().__init__(config)

        def _setup(self) -> None:
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return super()._setup()

            def setup() -> None:
                with _verl_091_setup_logging(module, self):
                    super(TimesliceSeparateAsync, self)._setup()

            return run(lc, init_plan(lc), setup)

        def on_init_end(self) -> None:
            self._timeslice_sync(initial=True, push=super().on_init_end)

        def on_sample_begin(self) -> None:
            super().on_sample_begin()
            self.__dict__["_timeslice_sample_t0"] = time.monotonic()

        def on_sample_end(self) -> None:
            super().on_sample_end()
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return
            waited = time.monotonic() - self.__dict__.pop("_timeslice_sample_t0", time.monotonic())
            samples = int(self.config.data.train_batch_size) // max(1, int(self.parameter_sync_step))
            run(lc, sample_plan(
                lc.event(RolloutEvent, samples=samples, required_samples=samples, queue_wait_s=round(waited, 6)),
                lc.event(TrainStepEvent, local_step=int(self.local_trigger_step) + 1, samples=samples)))

        def _save_checkpoint(self) -> None:
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return super()._save_checkpoint()
            force = int(self.global_steps) >= int(getattr(self, "total_training_steps", 0) or 0)
            return run(lc, save_plan(lc, force=force, where=f"step {self.global_steps}"), super()._save_checkpoint)

        def on_step_end(self) -> None:
            self._timeslice_sync(initial=False, push=super().on_step_end)

        def _validate(self) -> dict[str, float]:
            lc = lifecycle_for(self, NAME)
            on = lc is not None and lc.settings.validate.enable
            return _submit_validation(self, lc) if on else super()._validate()

        def _timeslice_sync(self, *, initial: bool, push: Any) -> None:
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return push()

            def pushed() -> None:
                push()
                if not initial:
                    self.__dict__[_V1_VERSION_ATTR] = self.__dict__.get(_V1_VERSION_ATTR, 0) + 1
                    _flush_validation(self)  # the validations that ended since the last step

            # v1 saves before it pushes, so no save follows a push in the same step
            return run(lc, sync_plan(lc, initial=initial), pushed)

        def fit(self, *args: Any, **kwargs: Any) -> Any:
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return super().fit(*args, **kwargs)
            return run(lc, fit_plan(lc, on_exit=lambda: _end_validation(self, lc)),
                       lambda: super(TimesliceSeparateAsync, self).fit(*args, **kwargs))

    setattr(TimesliceSeparateAsync, V1_MARKER, True)
    TimesliceSeparateAsync.__module__ = __name__
    return TimesliceSeparateAsync


def install(module: ModuleType) -> type:
    """Register the subclass as ``timeslice`` and in place of ``separate_async`` (idempotent)."""
    from verl.trainer.ppo.v1 import trainer_base

    current = trainer_base.TRAINER_REGISTRY.get("separate_async")
    if current is not None and getattr(current, V1_MARKER, False):
        return current
    cls = build(module)
    trainer_base.TRAINER_REGISTRY["separate_async"] = cls  # inert without a timeslice section
    trainer_base.register_trainer(TRAINER_NAME)(cls)
    module.TimesliceSeparateAsync = cls
    log.debug("v1 adapter: %s registered as %r and 'separate_async'", cls.__qualname__, TRAINER_NAME)
    return cls
