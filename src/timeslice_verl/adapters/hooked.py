"""Fork adapter: verl builds with fully-async lifecycle hooks and a trainer registry.

Those builds (the ``feat/fully-async-lifecycle-hooks`` line) give ``FullyAsyncTrainer`` empty
template methods that the trainer calls at its phase transitions —
``on_init_workers_begin/_end``, ``on_sample_end``, ``on_update_weights_begin/_end(synced)``,
``on_save_checkpoint(force) -> bool`` and ``on_exception(point, exc)`` — and pick the trainer class
by ``async_training.trainer_name`` from a registry filled with ``register_trainer(name)``.

:func:`install` registers a subclass under the name ``timeslice`` whose ``on_*`` methods drive the same plans
as the other adapters (:mod:`timeslice_verl.adapters.plans`): a ``…_begin`` hook runs its plan up to verl's own
work, the matching ``…_end`` (or the end of ``_fit_save_checkpoint``, or ``on_exception``) runs the rest. It adds
what those hooks do not cover: ``save_checkpoint_end``, the stop event at the end of ``fit`` and
``trainer_exception`` for a crash in the pre-fit weight sync, which ``fully_async_main`` runs outside ``fit()``.
"""

from __future__ import annotations

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
from timeslice_verl.adapters.plans import Paused, abegin, arun, begin, fit_plan, init_plan, sample_plan, save_plan, sync_plan
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
_PAUSED = "_timeslice_paused"
"""The trainer's plans paused at verl's own work, by what they wait for (``init``, ``sync``, ``save``)."""


def has_registry(module: ModuleType) -> bool:
    return callable(getattr(module, "register_trainer", None))


def missing_hooks(module: ModuleType) -> list[str]:
    """What verl's fully-async trainer ``module`` lacks for this adapter (its trainer registry, then the
    trainer's ``on_*`` methods); [] where it has everything."""
    if not has_registry(module):
        return ["register_trainer"]
    trainer = getattr(module, "FullyAsyncTrainer", None)
    if trainer is None:
        return ["FullyAsyncTrainer"]
    base = getattr(trainer, "__ray_actor_class__", trainer)
    return [m for m in HOOK_METHODS if not callable(getattr(base, m, None))]


def install(module: ModuleType) -> type | None:
    """Register the ``timeslice`` trainer in ``module``'s registry; None when it has no registry."""
    if not has_registry(module):
        return None
    existing = getattr(module, "__timeslice_hooked_trainer__", None)
    if existing is not None:
        return existing
    base = getattr(module.FullyAsyncTrainer, "__ray_actor_class__", module.FullyAsyncTrainer)
    missing = missing_hooks(module)
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


def _paused(trainer: Any) -> dict[str, Paused]:
    return trainer.__dict__.setdefault(_PAUSED, {})


async def _end(trainer: Any, what: str, result: Any = None, error: BaseException | None = None) -> None:
    """The rest of the plan paused for ``what``; an error verl raised is reported by the plan and raised here."""
    paused = _paused(trainer).pop(what, None)
    if paused is not None:
        await paused.aend(result, error)


async def _end_interrupted(trainer: Any, error: BaseException) -> None:
    """Every plan verl's error interrupted reports it and ends (the error itself is verl's to raise)."""
    for what in list(_paused(trainer)):
        try:
            await _end(trainer, what, error=error)
        except BaseException:  # noqa: S110 - verl's own error, which verl raises itself
            pass


class _Hooked:
    """What the ``timeslice`` trainer adds to verl's FullyAsyncTrainer (the base comes next in its MRO)."""

    async def on_init_workers_begin(self) -> None:
        await super().on_init_workers_begin()  # type: ignore[misc]
        lc = lifecycle_for(self, NAME)
        if lc is not None:
            _paused(self)["init"] = await abegin(lc, init_plan(lc))

    async def on_init_workers_end(self) -> None:
        await super().on_init_workers_end()  # type: ignore[misc]
        await _end(self, "init")

    async def on_sample_end(self) -> None:
        await super().on_sample_end()  # type: ignore[misc]
        lc = lifecycle_for(self, NAME)
        if lc is not None:
            await abegin(lc, sample_plan(rollout_event(lc, self), train_step_event(lc, self)))

    async def on_update_weights_begin(self) -> None:
        await super().on_update_weights_begin()  # type: ignore[misc]
        lc = lifecycle_for(self, NAME)
        if lc is not None:
            plan = sync_plan(lc, initial=not in_fit(self), synced=bool, save_follows=lambda: save_due(self))
            _paused(self)["sync"] = await abegin(lc, plan)

    async def on_update_weights_end(self, synced: bool) -> None:
        await super().on_update_weights_end(synced)  # type: ignore[misc]
        await _end(self, "sync", bool(synced))

    def on_save_checkpoint(self, force: bool) -> bool:
        allowed = super().on_save_checkpoint(force) is not False  # type: ignore[misc]
        lc = lifecycle_for(self, NAME)
        if lc is None or not allowed:
            return allowed
        where = f"param version {getattr(self, 'current_param_version', '?')}"
        paused = begin(lc, save_plan(lc, force=bool(force), where=where))
        if paused.done:  # a plugin vetoed it: the plan said so and ended
            return False
        _paused(self)["save"] = paused
        return True

    def _fit_save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        try:
            result = super()._fit_save_checkpoint(*args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            paused = _paused(self).pop("save", None)
            if paused is not None:
                paused.end(error=exc)  # a save that raised did not save: the plan says so, then re-raises
            raise
        paused = _paused(self).pop("save", None)
        if paused is not None:
            paused.end(result)
        return result

    async def on_exception(self, point: str, exc: BaseException) -> None:
        await super().on_exception(point, exc)  # type: ignore[misc]
        lc = lifecycle_for(self, NAME)
        if lc is not None:
            await _end_interrupted(self, exc)
            await lc.areport_exception(point, exc)

    async def _fit_update_weights(self, *args: Any, **kwargs: Any) -> Any:
        # The pre-fit sync runs outside fit(), whose handler fires on_exception: cover it here.
        try:
            return await super()._fit_update_weights(*args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            lc = lifecycle_for(self, NAME)
            if lc is not None:
                await _end_interrupted(self, exc)
                await lc.areport_exception("update_weights", exc)
            raise

    async def fit(self, *args: Any, **kwargs: Any) -> Any:
        lc = lifecycle_for(self, NAME)
        if lc is None:
            return await super().fit(*args, **kwargs)  # type: ignore[misc]
        set_in_fit(self, True)
        return await arun(lc, fit_plan(lc, on_exit=lambda: set_in_fit(self, False)),
                          lambda: super(_Hooked, self).fit(*args, **kwargs))  # type: ignore[misc]


def _make_trainer(base: type) -> type:
    cls = type("TimesliceFullyAsyncTrainer", (_Hooked, base), {
        "__doc__": "verl's FullyAsyncTrainer whose lifecycle hooks fire timeslice's hookspec.", "__module__": __name__})
    setattr(cls, HOOKED_MARKER, True)
    return cls
