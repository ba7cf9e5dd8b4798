"""The lifecycle hookspec: what a verl fully-async trainer tells its hook plugins, and when.

Events are named for what happened in the trainer (docs/architecture.md §3). Every hook takes explicit
keyword context — ``trainer`` (the verl trainer instance, or the demo's stand-in) and ``event`` (a
frozen record from :mod:`timeslice_verl.events`); an implementation may declare only the
arguments it needs. Calls are synchronous and run off the trainer actor's event loop, so a hook
may block (the bundled agent plugin waits there for the GPU).

Two kinds of hooks:

* **gating** hooks run before the trainer touches the GPU. An exception raised by a plugin stops
  the trainer (it must never train without the GPU it asked for): ``timeslice_start``,
  ``init_workers_begin``, ``pre_train_step``, ``weight_sync_begin``, ``save_checkpoint_begin``.
* **observing** hooks report. A plugin that raises is logged with its name and the trainer goes
  on; the remaining plugins are still called: every other hook.

The reference page ``guides/hook-reference.md`` documents every hook; a test keeps the two in step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from timeslice_verl.events import (
        CheckpointEvent,
        ExceptionEvent,
        HandoffEvent,
        InitWorkersEvent,
        RolloutEvent,
        RunEvent,
        TrainStepEvent,
        WeightSyncEvent,
    )
    from timeslice_verl.lifecycle import Lifecycle

PROJECT = "timeslice_verl"
"""pluggy project name; also the entry-point group third-party plugins publish under."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RunSpecs:
    """Set-up and tear-down of time-slicing in the process that fires events."""

    @hookspec
    def timeslice_start(self, trainer: Any, event: RunEvent, lifecycle: Lifecycle) -> None:
        """Time-slicing starts in this trainer process (gating).

        Fired once, before the first lifecycle event. ``lifecycle`` gives access to the validated
        settings (``lifecycle.settings``), the job name and ``lifecycle.notify(hook, event)`` for
        plugins that report events of their own (the agent plugin fires ``handoff`` through it).
        Open files and connections here.
        """

    @hookspec
    def timeslice_stop(self, trainer: Any, event: RunEvent) -> None:
        """Time-slicing ends in this process (observing).

        ``event.reason`` is ``finished`` after ``fit()`` returned and ``error`` after it raised.
        Close what ``timeslice_start`` opened; the agent plugin hands the GPU back here.
        """


class InitWorkersSpecs:
    """Worker groups are created and the models loaded onto the trainer's GPUs."""

    @hookspec
    def init_workers_begin(self, trainer: Any, event: InitWorkersEvent) -> None:
        """``init_workers`` is about to create worker groups and load models (gating).

        The agent plugin acquires the GPU here: model loading needs it.
        """

    @hookspec
    def init_workers_end(self, trainer: Any, event: InitWorkersEvent) -> None:
        """``init_workers`` returned; ``event.elapsed_s`` says how long it took (observing).

        The agent plugin releases the GPU here: the trainer next waits for samples.
        """


class RolloutSpecs:
    """Samples arriving from the rollout engines."""

    @hookspec
    def post_rollout(self, trainer: Any, event: RolloutEvent) -> None:
        """A batch of rollout samples was dequeued and assembled (observing).

        Carries the sample count, the required count and how long the trainer waited on the
        queue. The agent plugin uses it to learn the rhythm of the run (for ``prepare``).
        """


class TrainStepSpecs:
    """The training step proper."""

    @hookspec
    def pre_train_step(self, trainer: Any, event: TrainStepEvent) -> None:
        """The step is about to touch the GPU: the resume point (gating).

        The agent plugin blocks here until the trainer's GPU processes are restored.
        """


class WeightSyncSpecs:
    """The push of new weights to the rollout engines."""

    @hookspec
    def weight_sync_begin(self, trainer: Any, event: WeightSyncEvent) -> None:
        """``_fit_update_weights`` starts (gating).

        ``event.initial`` marks the pre-fit sync that ``fully_async_main`` runs before ``fit()``.
        The agent plugin makes sure the GPU is held (a real acquire only for that initial sync).
        """

    @hookspec
    def weight_sync_end(self, trainer: Any, event: WeightSyncEvent) -> None:
        """``_fit_update_weights`` returned (observing).

        ``event.synced`` is True when weights were pushed, False when the call was a no-op
        (``trigger_parameter_sync_step`` > 1 and not the last local step). The agent plugin
        releases the GPU only when synced.
        """


class CheckpointSpecs:
    """Checkpoint saves of the trainer's models."""

    @hookspec
    def save_checkpoint_begin(self, trainer: Any, event: CheckpointEvent) -> bool | None:
        """A checkpoint save is about to run (gating, may veto).

        Return ``False`` to skip this save; ``None`` or ``True`` allows it. The save runs when no
        plugin returned ``False``. The agent plugin holds the GPU for the save and allows it.
        """

    @hookspec
    def save_checkpoint_end(self, trainer: Any, event: CheckpointEvent) -> None:
        """The save finished or was vetoed: ``event.saved`` says which (observing).

        The agent plugin gives back a GPU it took only for the save.
        """


class ErrorSpecs:
    """Failures."""

    @hookspec
    def trainer_exception(self, trainer: Any, event: ExceptionEvent) -> None:
        """An error escaped the trainer (observing). Fired once per exception.

        ``event.point`` names where (``init_workers``, ``update_weights``, ``fit``…) and
        ``event.error`` is the exception itself, which still propagates after the hook. The agent
        plugin crash-releases the GPU here.
        """


class HandoffSpecs:
    """Reports from the agent plugin, for observers (timeline, metrics, your own)."""

    @hookspec
    def handoff(self, trainer: Any, event: HandoffEvent) -> None:
        """The trainer side of a GPU handoff finished (observing).

        ``event.action`` is ``acquire``, ``release``, ``prepare`` or ``crash_release``;
        ``event.waited_s`` is how long the trainer was blocked; ``event.transitions`` are the
        agent's moves (freeze, thaw, tenant yield/reclaim, with their times and bytes).
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
)

GATING_HOOKS: frozenset[str] = frozenset(
    {"timeslice_start", "init_workers_begin", "pre_train_step", "weight_sync_begin", "save_checkpoint_begin"}
)


def hook_names() -> list[str]:
    """Every hook of the spec, in lifecycle order."""
    return [
        name
        for cls in SPEC_CLASSES
        for name, fn in vars(cls).items()
        if callable(fn) and not name.startswith("_")
    ]
