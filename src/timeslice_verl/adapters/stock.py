"""Stock adapter: fire the lifecycle events from PyPI verl's ``FullyAsyncTrainer``, which has no hooks.

Wraps these seams of ``FullyAsyncTrainer.__ray_actor_class__`` (docs/architecture.md §3), in place:

=============================  =========================================================
seam                           events
=============================  =========================================================
``init_workers``               init_workers_begin / init_workers_end
``_get_samples_from_queue``    post_rollout (when it returned a batch)
``_fit_generate``              pre_train_step (on return: the step touches the GPU next)
``_fit_update_weights``        weight_sync_begin / weight_sync_end (synced = returned non-None);
                               also the pre-fit call of ``fully_async_main`` (initial=True)
``_fit_save_checkpoint``       remembers ``force`` for the save below
``_save_checkpoint``           save_checkpoint_begin (may veto) / save_checkpoint_end
``_fit_validate``              with ``timeslice.validate.enable``: the version to the policy tenant, not awaited
``fit``                        trainer_exception on error; timeslice_stop at the end
=============================  =========================================================

Errors escaping ``init_workers``, ``_fit_update_weights`` or ``fit`` fire ``trainer_exception``
once and propagate unchanged. Wrapping is idempotent, keeps each method's signature, docstring and
async-ness (Ray inspects them), and is inert for a trainer without an enabled ``timeslice`` section.

The seams are plain functions (``functools.wraps``), not ``wrapt`` proxies as ``verl_entry`` uses for
``run_ppo``: Ray pickles verl's trainer class *by value* to the actor's process (the module's
``FullyAsyncTrainer`` is the ActorClass, so the class cannot be found by reference), and cloudpickle takes a
wrapt proxy for the function it wraps — the seam would arrive unwrapped (``tests/test_adapters.py``'s real
Ray actor test showed it). A function travels whole.

Each seam is written once, as a *plan* (:mod:`timeslice_verl.adapters.plans`, shared with the other
adapters): a generator that yields what to do and gets the outcome back, driven the same way from a
synchronous or an asynchronous verl method.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from timeslice_verl.adapters.common import in_fit, lifecycle_for, rollout_event, save_due, set_in_fit, train_step_event
from timeslice_verl.adapters.plans import CALL, Fire, Plan, arun, fit_plan, init_plan, run, save_plan, sync_plan
from timeslice_verl.adapters.transfer import captured_transfer
from timeslice_verl.hooks.lifecycle import Lifecycle
from timeslice_verl.log import get_logger

log = get_logger("adapter.stock")

NAME = "stock"
WRAPPED_MARK = "__timeslice_wrapped__"
_SUBMITTED = "_timeslice_validation_submitted"
"""The version whose validation the end of its weight sync submitted (``_fit_validate`` does not again)."""


# --------------------------------------------------------------------------- the plans


def _plan_init_workers(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    return (yield from init_plan(lc))


def _plan_get_samples(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    result = yield CALL
    if isinstance(result, tuple) and len(result) == 2 and result[1] is not None:
        yield Fire(Lifecycle.post_rollout, rollout_event(lc, self, result[1]))
    return result


def _plan_fit_generate(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    batch = yield CALL
    if batch is not None:
        yield Fire(Lifecycle.pre_train_step, train_step_event(lc, self))
    return batch


def _plan_update_weights(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    with captured_transfer(self) as pushed:
        return (yield from sync_plan(lc, initial=not in_fit(self), synced=lambda result: result is not None,
                                     save_follows=lambda: save_due(self),
                                     before_end=lambda synced: _validate_before_release(self, lc, synced),
                                     pushed=lambda: pushed[-1] if pushed else None))


def _validate_before_release(self: Any, lc: Lifecycle, synced: bool) -> None:
    """A due version's weights are taken from the trainer's ranks while it still holds its GPUs: verl validates after
    the weight sync, and by then the end of the sync may have lent them — the ranks' CUDA calls then waited for the
    trainer's next acquire, and so did the trainer (the run's last version was never validated). ``_fit_validate``
    then only logs what ended. The first sync is followed by verl's ``val_before_train`` when its config says so."""
    if not synced or not lc.settings.validate.enable:
        return
    from timeslice_verl.validate.setup import submit  # only where validation is on: the core stays light

    version = int(getattr(self, "current_param_version", 0))
    before = not in_fit(self)
    if before and not _val_before_train(self):
        return
    submit(self, lc, version, force=before)
    self.__dict__[_SUBMITTED] = version


def _val_before_train(trainer: Any) -> bool:
    try:
        return bool(trainer.config.trainer.get("val_before_train", True))
    except AttributeError:
        return False


def _plan_fit_save_checkpoint(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    self.__dict__["_timeslice_save_force"] = bool(kwargs.get("force", args[0] if args else False))
    try:
        return (yield CALL)
    finally:
        self.__dict__.pop("_timeslice_save_force", None)


def _plan_save_checkpoint(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    force = bool(self.__dict__.get("_timeslice_save_force", False))
    return (yield from save_plan(lc, force=force, where=f"param version {getattr(self, 'current_param_version', '?')}"))


def _plan_fit_validate(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    """verl awaits its validation here; with ``timeslice.validate.enable`` the version goes to the policy tenant
    instead and the trainer goes on (:mod:`timeslice_verl.validate`)."""
    if not lc.settings.validate.enable:
        return (yield CALL)
    if getattr(self, "local_trigger_step", 1) != 1:  # verl's own guard: a version is validated once
        from timeslice_verl.validate.setup import flush

        flush(self)
        return None
    from timeslice_verl.validate.setup import flush, submit  # only where validation is on: the core stays light

    flush(self)  # what ended since the last step, logged on the trainer's thread
    version = int(getattr(self, "current_param_version", 0))
    if self.__dict__.pop(_SUBMITTED, None) == version:
        return None  # taken at the end of its sync, before the GPUs could be lent
    before = bool(kwargs.get("val_before_train", args[0] if args else False))
    submit(self, lc, version, force=before)
    return None


def _end_fit(self: Any, lc: Lifecycle) -> None:
    set_in_fit(self, False)
    if lc.settings.validate.enable:
        from timeslice_verl.validate.setup import close_validator

        close_validator(self, lc.settings.validate.finish_s)


def _plan_fit(self: Any, lc: Lifecycle, args: tuple, kwargs: dict) -> Plan:
    set_in_fit(self, True)
    return (yield from fit_plan(lc, on_exit=lambda: _end_fit(self, lc)))


PLANS: dict[str, Callable[..., Plan]] = {
    "init_workers": _plan_init_workers,
    "_get_samples_from_queue": _plan_get_samples,
    "_fit_generate": _plan_fit_generate,
    "_fit_update_weights": _plan_update_weights,
    "_fit_save_checkpoint": _plan_fit_save_checkpoint,
    "_save_checkpoint": _plan_save_checkpoint,
    "_fit_validate": _plan_fit_validate,
    "fit": _plan_fit,
}
SEAMS = tuple(PLANS)


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    make_plan = PLANS[name]

    if inspect.iscoroutinefunction(original):

        async def seam(self: Any, *args: Any, **kwargs: Any) -> Any:
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return await original(self, *args, **kwargs)
            return await arun(lc, make_plan(self, lc, args, kwargs), lambda: original(self, *args, **kwargs))

    else:

        def seam(self: Any, *args: Any, **kwargs: Any) -> Any:
            lc = lifecycle_for(self, NAME)
            if lc is None:
                return original(self, *args, **kwargs)
            return run(lc, make_plan(self, lc, args, kwargs), lambda: original(self, *args, **kwargs))

    wrapped = functools.wraps(original)(seam)
    wrapped.__timeslice_seam__ = name  # type: ignore[attr-defined]
    return wrapped


# --------------------------------------------------------------------------- install


def raw_class(cls: Any) -> type:
    """The Python class behind a Ray ``ActorClass`` (or ``cls`` itself)."""
    return getattr(cls, "__ray_actor_class__", cls)


def _targets(trainer_cls: Any) -> list[type]:
    """The raw class, and the subclass Ray instantiates for ``.remote()`` when there is one.

    ``@ray.remote`` builds that subclass at decoration time and copies every method into it
    (wrapped for tracing), so patching the raw class alone would not reach a Ray actor.
    """
    targets = [raw_class(trainer_cls)]
    modified = getattr(getattr(trainer_cls, "__ray_metadata__", None), "modified_class", None)
    if isinstance(modified, type) and modified is not targets[0]:
        targets.append(modified)
    return targets


def is_installed(cls: Any) -> bool:
    return bool(raw_class(cls).__dict__.get(WRAPPED_MARK, False))


def install(trainer_cls: Any) -> type:
    """Wrap the seams of ``trainer_cls`` (an ActorClass or its raw class) in place; idempotent."""
    cls = raw_class(trainer_cls)
    if cls.__dict__.get(WRAPPED_MARK):
        return cls
    missing = [name for name in SEAMS if not callable(getattr(cls, name, None))]
    if missing:
        raise RuntimeError(
            f"timeslice stock adapter: {cls.__module__}.{cls.__qualname__} lacks {', '.join(missing)}; "
            "this verl version is not supported (verl 0.9.x is)"
        )
    for target in _targets(trainer_cls):
        for name in SEAMS:
            if name in target.__dict__ and not hasattr(target.__dict__[name], "__timeslice_seam__"):
                setattr(target, name, _wrap(name, target.__dict__[name]))
        setattr(target, WRAPPED_MARK, True)
    log.debug("wrapped %s.%s seams: %s", cls.__module__, cls.__qualname__, ", ".join(SEAMS))
    return cls


def uninstall(trainer_cls: Any) -> None:
    """Put the original methods back (tests)."""
    if not is_installed(trainer_cls):
        return
    for target in _targets(trainer_cls):
        for name in SEAMS:
            current = target.__dict__.get(name)
            if current is not None and hasattr(current, "__timeslice_seam__"):
                setattr(target, name, current.__wrapped__)
        if WRAPPED_MARK in target.__dict__:
            delattr(target, WRAPPED_MARK)
