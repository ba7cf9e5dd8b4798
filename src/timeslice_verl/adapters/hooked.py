"""Fork adapter: verl builds with fully-async lifecycle hooks and a trainer registry.

Those builds (the ``feat/fully-async-lifecycle-hooks`` line) give ``FullyAsyncTrainer`` empty
template methods that the trainer calls at its phase transitions —
``on_init_workers_begin/_end``, ``on_sample_end``, ``on_update_weights_begin/_end(synced)``,
``on_save_checkpoint(force) -> bool`` and ``on_exception(point, exc)`` — and pick the trainer class
by ``async_training.trainer_name`` from a registry filled with ``register_trainer(name)``.

:func:`install` registers a subclass under the name ``timeslice`` whose ``on_*`` methods dispatch
into the hookspec. It adds what those hooks do not cover: ``save_checkpoint_end``, the stop event
at the end of ``fit`` and ``trainer_exception`` for a crash in the pre-fit weight sync, which
``fully_async_main`` runs outside ``fit()``.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

from timeslice_verl.adapters.common import (
    HOOKED_MARKER,
    in_fit,
    lifecycle_for,
    rollout_event,
    save_due,
    set_in_fit,
    train_step_event,
)
from timeslice_verl.adapters.plans import arun, fit_plan
from timeslice_verl.events import CheckpointEvent, InitWorkersEvent, WeightSyncEvent
from timeslice_verl.log import get_logger

log = get_logger("adapter.hooked")

NAME = "hooked"
TRAINER_NAME = "timeslice"
HOOK_METHODS = (
    "on_init_workers_begin",
    "on_init_workers_end",
    "on_sample_end",
    "on_update_weights_begin",
    "on_update_weights_end",
    "on_save_checkpoint",
    "on_exception",
)


def has_registry(module: ModuleType) -> bool:
    return callable(getattr(module, "register_trainer", None))


def install(module: ModuleType) -> type | None:
    """Register the ``timeslice`` trainer in ``module``'s registry; None when it has no registry."""
    if not has_registry(module):
        return None
    existing = getattr(module, "__timeslice_hooked_trainer__", None)
    if existing is not None:
        return existing
    base = getattr(module.FullyAsyncTrainer, "__ray_actor_class__", module.FullyAsyncTrainer)
    missing = [m for m in HOOK_METHODS if not callable(getattr(base, m, None))]
    if missing:
        log.warning(
            "verl's trainer registry exists but FullyAsyncTrainer lacks %s: hooked adapter not installed",
            ", ".join(missing),
        )
        return None
    cls = _make_trainer(base)
    module.register_trainer(TRAINER_NAME)(cls)
    module.__timeslice_hooked_trainer__ = cls
    log.debug("registered fully-async trainer %r (%s)", TRAINER_NAME, cls.__qualname__)
    return cls


def _make_trainer(base: type) -> type:
    class TimesliceFullyAsyncTrainer(base):  # type: ignore[misc, valid-type]
        """verl's FullyAsyncTrainer whose lifecycle hooks fire timeslice's hookspec."""

        async def on_init_workers_begin(self) -> None:
            await super().on_init_workers_begin()
            lc = lifecycle_for(self, NAME)
            if lc is not None:
                self.__dict__["_timeslice_init_t0"] = time.monotonic()
                await lc.fire("init_workers_begin", lc.event(InitWorkersEvent))

        async def on_init_workers_end(self) -> None:
            await super().on_init_workers_end()
            lc = lifecycle_for(self, NAME)
            if lc is not None:
                t0 = self.__dict__.pop("_timeslice_init_t0", time.monotonic())
                await lc.fire("init_workers_end", lc.event(InitWorkersEvent, elapsed_s=round(time.monotonic() - t0, 6)))

        async def on_sample_end(self) -> None:
            await super().on_sample_end()
            lc = lifecycle_for(self, NAME)
            if lc is not None:
                await lc.fire("post_rollout", rollout_event(lc, self))
                await lc.fire("pre_train_step", train_step_event(lc, self))

        async def on_update_weights_begin(self) -> None:
            await super().on_update_weights_begin()
            lc = lifecycle_for(self, NAME)
            if lc is not None:
                self.__dict__["_timeslice_sync_t0"] = time.monotonic()
                await lc.fire("weight_sync_begin", lc.event(WeightSyncEvent, initial=not in_fit(self)))

        async def on_update_weights_end(self, synced: bool) -> None:
            await super().on_update_weights_end(synced)
            lc = lifecycle_for(self, NAME)
            if lc is not None:
                t0 = self.__dict__.pop("_timeslice_sync_t0", time.monotonic())
                initial = not in_fit(self)
                event = lc.event(
                    WeightSyncEvent, initial=initial, synced=bool(synced), elapsed_s=round(time.monotonic() - t0, 6),
                    save_follows=bool(synced) and not initial and save_due(self),
                )
                await lc.fire("weight_sync_end", event)

        def on_save_checkpoint(self, force: bool) -> bool:
            allowed = super().on_save_checkpoint(force) is not False
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return allowed
            results = lc.call("save_checkpoint_begin", lc.event(CheckpointEvent, force=bool(force)))
            allowed = allowed and False not in results
            self.__dict__["_timeslice_save"] = (bool(force), allowed, time.monotonic())
            return allowed

        def _fit_save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            completed = False
            try:
                result = super()._fit_save_checkpoint(*args, **kwargs)
                completed = True
                return result
            finally:
                pending = self.__dict__.pop("_timeslice_save", None)
                lc = lifecycle_for(self, NAME)
                if pending is not None and lc is not None:
                    force, allowed, t0 = pending
                    saved = allowed and completed  # a save that raised did not save
                    elapsed = round(time.monotonic() - t0, 6) if saved else 0.0
                    lc.call("save_checkpoint_end", lc.event(CheckpointEvent, force=force, saved=saved, elapsed_s=elapsed))

        async def on_exception(self, point: str, exc: BaseException) -> None:
            await super().on_exception(point, exc)
            lc = lifecycle_for(self, NAME)
            if lc is not None:
                await lc.areport_exception(point, exc)

        async def _fit_update_weights(self, *args: Any, **kwargs: Any) -> Any:
            # The pre-fit sync runs outside fit(), whose handler fires on_exception: cover it here.
            try:
                return await super()._fit_update_weights(*args, **kwargs)
            except BaseException as exc:
                lc = lifecycle_for(self, NAME)
                if lc is not None:
                    await lc.areport_exception("update_weights", exc)
                raise

        async def fit(self, *args: Any, **kwargs: Any) -> Any:
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return await super().fit(*args, **kwargs)
            set_in_fit(self, True)
            return await arun(lc, fit_plan(lc, on_exit=lambda: set_in_fit(self, False)),
                              lambda: super(TimesliceFullyAsyncTrainer, self).fit(*args, **kwargs))

    setattr(TimesliceFullyAsyncTrainer, HOOKED_MARKER, True)
    return TimesliceFullyAsyncTrainer
