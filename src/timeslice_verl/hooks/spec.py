"""The lifecycle hookspec: what a verl fully-async trainer tells its hook plugins, and when.

Events are named for what happened in the trainer (docs/architecture.md §3). Every hook takes explicit
keyword context — ``trainer`` (the verl trainer instance, or the demo's stand-in) and ``event`` (a
frozen record from :mod:`timeslice_verl.hooks.events`); an implementation may declare only the
arguments it needs. Calls are synchronous and run off the trainer actor's event loop, so a hook
may block (the bundled agent plugin waits there for the GPU).

Two kinds of hooks, declared on each specification (``@gating`` / ``@observing``):

* **gating** hooks run before the trainer touches the GPU. An exception raised by a plugin stops
  the trainer (it must never train without the GPU it asked for).
* **observing** hooks report. A plugin that raises is logged with its name and the trainer goes
  on; the remaining plugins are still called.

The reference page ``guides/hook-reference.md`` documents every hook; a test keeps the two in step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from timeslice_verl.config.schema import TimesliceSettings
    from timeslice_verl.hooks.events import (
        CheckpointEvent,
        ExceptionEvent,
        HandoffEvent,
        ValidationEvent,
        InitWorkersEvent,
        RolloutEvent,
        RunEvent,
        TrainStepEvent,
        WeightSyncEvent,
    )

PROJECT = "timeslice_verl"
"""pluggy project name; also the entry-point group third-party plugins publish under."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

GATING, OBSERVING = "gating", "observing"
KIND_ATTR = "timeslice_kind"
F = TypeVar("F", bound=Callable[..., Any])


def gating(spec: F) -> F:
    """The hook runs before the trainer touches the GPU: the first plugin error stops the trainer."""
    setattr(spec, KIND_ATTR, GATING)
    return spec


def observing(spec: F) -> F:
    """The hook reports: a plugin that raises is logged with its name and the others still run."""
    setattr(spec, KIND_ATTR, OBSERVING)
    return spec


class LifecycleContext(Protocol):
    """What ``timeslice_start`` hands plugins as ``lifecycle``: the dispatcher, as far as plugins use it."""

    settings: TimesliceSettings
    job: str
    trainer: Any
    ranks: Any
    """The trainer's GPU ranks as the adapter sees them (``local_pids()``, ``release_caches()``, ``park()``…), or None."""
    backlog: Any
    """``() -> (queued, required)`` samples for the trainer's next step, read off verl; or None."""

    def event(self, cls: type, **fields: Any) -> Any:
        """A record of ``cls`` stamped with the job, the trainer's step and param version, and now."""

    def handoff(self, event: HandoffEvent) -> None:
        """Report a handoff to the observers (the agent plugin does, from inside the hook that caused it)."""


class RunSpecs:
    """Set-up and tear-down of time-slicing in the process that fires events."""

    @hookspec
    @gating
    def timeslice_start(self, trainer: Any, event: RunEvent, lifecycle: LifecycleContext) -> None:
        """Time-slicing starts in this trainer process.

        Fired once, before the first lifecycle event. ``lifecycle`` gives access to the validated
        settings (``lifecycle.settings``), the job name, the trainer's ranks and ``lifecycle.handoff(event)``
        for plugins that report handoffs of their own (the agent plugin does).
        Open files and connections here.
        """

    @hookspec
    @observing
    def timeslice_stop(self, trainer: Any, event: RunEvent) -> None:
        """Time-slicing ends in this process.

        ``event.reason`` is ``finished`` after ``fit()`` returned and ``error`` after it raised.
        Close what ``timeslice_start`` opened; the agent plugin hands the GPU back here.
        """


class InitWorkersSpecs:
    """Worker groups are created and the models loaded onto the trainer's GPUs."""

    @hookspec
    @gating
    def init_workers_begin(self, trainer: Any, event: InitWorkersEvent) -> None:
        """``init_workers`` is about to create worker groups and load models.

        The agent plugin acquires the GPU here: model loading needs it.
        """

    @hookspec
    @observing
    def init_workers_end(self, trainer: Any, event: InitWorkersEvent) -> None:
        """``init_workers`` returned; ``event.elapsed_s`` says how long it took.

        The agent plugin releases the GPU here: the trainer next waits for samples.
        """


class RolloutSpecs:
    """Samples arriving from the rollout engines."""

    @hookspec
    @observing
    def post_rollout(self, trainer: Any, event: RolloutEvent) -> None:
        """A batch of rollout samples was dequeued and assembled.

        Carries the sample count, the required count and how long the trainer waited on the
        queue. (The agent plugin times its handoffs by verl's backlog itself: it needs no hook for it.)
        """


class TrainStepSpecs:
    """The training step proper."""

    @hookspec
    @gating
    def pre_train_step(self, trainer: Any, event: TrainStepEvent) -> None:
        """The step is about to touch the GPU: the resume point.

        The agent plugin blocks here until the trainer's GPU processes are restored.
        """


class WeightSyncSpecs:
    """The push of new weights to the rollout engines."""

    @hookspec
    @gating
    def weight_sync_begin(self, trainer: Any, event: WeightSyncEvent) -> None:
        """``_fit_update_weights`` starts.

        ``event.initial`` marks the pre-fit sync that ``fully_async_main`` runs before ``fit()``.
        The agent plugin makes sure the GPU is held (a real acquire only for that initial sync).
        """

    @hookspec
    @observing
    def weight_sync_end(self, trainer: Any, event: WeightSyncEvent) -> None:
        """``_fit_update_weights`` returned.

        ``event.synced`` is True when weights were pushed, False when the call was a no-op
        (``trigger_parameter_sync_step`` > 1 and not the last local step). The agent plugin
        releases the GPU only when synced.
        """


class CheckpointSpecs:
    """Checkpoint saves of the trainer's models."""

    @hookspec
    @gating
    def save_checkpoint_begin(self, trainer: Any, event: CheckpointEvent) -> bool | None:
        """A checkpoint save is about to run (may veto).

        Return ``False`` to skip this save; ``None`` or ``True`` allows it. The save runs when no
        plugin returned ``False``. The agent plugin holds the GPU for the save and allows it.
        """

    @hookspec
    @observing
    def save_checkpoint_end(self, trainer: Any, event: CheckpointEvent) -> None:
        """The save finished or was vetoed: ``event.saved`` says which.

        The agent plugin gives back a GPU it took only for the save.
        """


class ErrorSpecs:
    """Failures."""

    @hookspec
    @observing
    def trainer_exception(self, trainer: Any, event: ExceptionEvent) -> None:
        """An error escaped the trainer. Fired once per exception.

        ``event.point`` names where (``init_workers``, ``update_weights``, ``fit``…) and
        ``event.error`` is the exception itself, which still propagates after the hook. The agent
        plugin crash-releases the GPU here.
        """


class HandoffSpecs:
    """Reports from the agent plugin, for observers (timeline, metrics, your own)."""

    @hookspec
    @observing
    def handoff(self, trainer: Any, event: HandoffEvent) -> None:
        """The trainer side of a GPU handoff finished.

        ``event.action`` is ``acquire``, ``release``, ``prepare`` or ``crash_release``;
        ``event.waited_s`` is how long the trainer was blocked; ``event.transitions`` are the
        agent's moves (freeze, thaw, tenant yield/reclaim, with their times and bytes).
        """


class ValidationSpecs:
    """Validation in the valleys (``timeslice.validate``), for observers."""

    @hookspec
    @observing
    def validation_end(self, trainer: Any, event: ValidationEvent) -> None:
        """A validation run ended, on the validation's own thread (the trainer went on long ago).

        ``event.version`` is the weight version it validated, ``event.metrics`` verl's validation metrics (logged to
        verl's tracker at that version's step), ``event.error`` why it did not finish; ``event.late`` counts the runs
        that could not keep up with the trainer so far. The timeline records it.
        """


SPEC_CLASSES: tuple[type, ...] = (
    RunSpecs,
    InitWorkersSpecs,
    RolloutSpecs,
    TrainStepSpecs,
    WeightSyncSpecs,
    CheckpointSpecs,
    ErrorSpecs,
    HandoffSpecs,
    ValidationSpecs,
)

def hook_names() -> list[str]:
    """Every hook of the spec, in lifecycle order."""
    return [
        name
        for cls in SPEC_CLASSES
        for name, fn in vars(cls).items()
        if callable(fn) and not name.startswith("_")
    ]


def hook_kind(name: str) -> str:
    """``gating`` or ``observing``, as the hook's specification declares."""
    for cls in SPEC_CLASSES:
        spec = vars(cls).get(name)
        if spec is not None:
            return getattr(spec, KIND_ATTR)
    raise KeyError(f"no hook named {name!r}")


_undeclared = [n for cls in SPEC_CLASSES for n, f in vars(cls).items() if callable(f) and not n.startswith("_")
               and not hasattr(f, KIND_ATTR)]
if _undeclared:  # pragma: no cover - a new hook must say what kind it is
    raise TypeError(f"hook specification(s) {', '.join(_undeclared)} declare neither @gating nor @observing")

GATING_HOOKS: frozenset[str] = frozenset(n for n in hook_names() if hook_kind(n) == GATING)
