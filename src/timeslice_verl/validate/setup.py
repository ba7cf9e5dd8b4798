"""A :class:`~timeslice_verl.validate.runner.Validator` for one verl trainer, from its config and the
``timeslice.validate`` section (the adapters call :func:`validator_for` at the trainer's validation seam).

The trainer's weights come from ``timeslice.validate.source``: ``package.module:factory``, called with the trainer,
returning a :class:`~timeslice_verl.validate.runner.WeightSource` (the trainer's ranks' CUDA tensors as IPC handles
for a policy tenant on their GPU). Everything else is verl's own: ``data.val_files``, the validation sampling, the
reward function, ``trainer.test_freq`` (unless ``validate.every`` is set) and its tracker (``trainer.logger``).
"""

from __future__ import annotations

import collections
import importlib
import threading
from typing import Any, Callable


from timeslice_verl.batch.auth import client_key
from timeslice_verl.batch.client import BatchClient, served_model
from timeslice_verl.log import get_logger
from timeslice_verl.validate.policy import PolicyError, PolicyTenant
from timeslice_verl.hooks.events import ValidationEvent
from timeslice_verl.validate.runner import Run, Validator, WeightSource
from timeslice_verl.validate.schedule import Schedule
from timeslice_verl.validate.valset import Sampling, read_valset, scorer, verl_value

log = get_logger("validate")

_ATTR = "_timeslice_validator"
_PENDING = "_timeslice_validation_metrics"
_lock = threading.Lock()


class ValidationSetupError(RuntimeError):
    """Validation is on but cannot run: the message names the setting or the part that is missing."""


def load_source(spec: str) -> Callable[[Any], WeightSource]:
    """``package.module:factory`` → the factory (a clear error naming the setting otherwise)."""
    if not spec or ":" not in spec:
        raise ValidationSetupError("timeslice.validate.source: name the trainer's weight source as "
                                   f"'package.module:factory' (got {spec!r})")
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValidationSetupError(f"timeslice.validate.source={spec!r}: {type(exc).__name__}: {exc}") from None


def policy_model(url: str) -> str:
    """The model the policy tenant serves (a tenant that does not say is a :class:`PolicyError`)."""
    try:
        return served_model(url)
    except RuntimeError as exc:
        raise PolicyError(f"policy tenant: {exc}") from None


def _every(trainer: Any, settings: Any) -> int:
    return settings.validate.every or int(verl_value(trainer.config, "trainer.test_freq", 0) or 0)


def build(trainer: Any, lc: Any) -> Validator:
    """A validator for ``trainer`` (``lc``: its lifecycle — the settings, and the ``validation_end`` hook it fires)."""
    settings = lc.settings
    v, b, config = settings.validate, settings.batch, trainer.config
    every = _every(trainer, settings)
    if every <= 0:
        raise ValidationSetupError("timeslice.validate.enable=true, but neither validate.every nor verl's "
                                   "trainer.test_freq is above 0: no version would ever be due")
    files = verl_value(config, "data.val_files")
    if not files:
        raise ValidationSetupError("timeslice.validate.enable=true, but verl's data.val_files names no file")
    source = load_source(v.source)(trainer)
    service = v.service_url or f"http://{b.host}:{b.port}"
    logger = getattr(trainer, "logger", None)
    if logger is None:
        raise ValidationSetupError("the trainer has no tracker (trainer.logger): validation metrics would go nowhere")
    out = Validator(every=every, policy=PolicyTenant(v.policy_url), batch=BatchClient(service, client_key(b.key_file)),
                    source=source, prompts=read_valset(list(files) if not isinstance(files, str) else files),
                    sampling=Sampling.of(config), score=scorer(config), model=policy_model(v.policy_url),
                    log_metrics=lambda metrics, step: _pending(trainer).append((metrics, step)), priority=v.priority,
                    poll_s=v.poll_s, on_run=lambda run: _report(lc, run, out))
    log.info("[timeslice] validation in the valleys: every %d versions, %d prompts, policy tenant %s, batch service %s",
             every, len(out.prompts), v.policy_url, service)
    return out


def _pending(trainer: Any) -> collections.deque:
    """The validations' metrics not logged yet: verl's tracker is called on the trainer's own thread (a tracker such as
    wandb is not meant to be called from two threads at once), at :func:`flush`."""
    return trainer.__dict__.setdefault(_PENDING, collections.deque())


def flush(trainer: Any) -> int:
    """Log the validations' metrics that came in since the last flush, each at its version's step (the adapters call
    it at every step and at the end); how many."""
    pending, logger, done = trainer.__dict__.get(_PENDING), getattr(trainer, "logger", None), 0
    while pending and logger is not None:
        metrics, step = pending.popleft()
        logger.log(data=metrics, step=step)
        done += 1
    return done


def _report(lc: Any, run: Run, validator: Validator) -> None:
    lc.validation_end(lc.event(ValidationEvent, version=run.version, batch_id=run.batch_id, status=run.status,
                               answers=run.answers, push_s=round(run.push_s, 3), seconds=round(run.seconds, 3),
                               late=len(validator.schedule.late), error=run.error, metrics=dict(run.metrics)))


def submit(trainer: Any, lc: Any, version: int, force: bool = False) -> bool:
    """Hand ``version`` to the trainer's validator; never raises into the trainer: a validation that cannot be set up
    or submitted (the policy tenant or the service down, the validation set unreadable) is logged and reported
    (``validation_end`` with the error), the version left unvalidated, and the next due version tries again."""
    if not force and not Schedule(_every(trainer, lc.settings)).due(version):
        return True  # nothing to do (not due): nothing built, nothing reported
    try:
        validator_for(trainer, lc).synced(version, force)
        return True
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.error("[timeslice] validation of version %d not submitted (training goes on): %s", version, error)
        lc.validation_end(lc.event(ValidationEvent, version=version, error=error))
        return False


def validator_for(trainer: Any, lc: Any) -> Validator:
    """The trainer's validator, built on first use and kept on the trainer (never pickled with it)."""
    with _lock:
        made = trainer.__dict__.get(_ATTR)
        if made is None:
            made = trainer.__dict__[_ATTR] = build(trainer, lc)
        return made


def validator_of(trainer: Any) -> Validator | None:
    """The trainer's validator, if one was built (its runs so far, its schedule's late reports)."""
    return trainer.__dict__.get(_ATTR)


def close_validator(trainer: Any, wait_s: float = 0.0) -> None:
    made = trainer.__dict__.pop(_ATTR, None)
    if made is not None:
        runs = made.close(wait_s)
        flush(trainer)
        log.info("[timeslice] validation: %d run(s), %d late report(s)", len(runs), len(made.schedule.late))


__all__ = ["ValidationSetupError", "build", "close_validator", "flush", "load_source", "policy_model", "submit",
           "validator_for", "validator_of"]
