"""A recording plugin, a lifecycle factory and a scripted fully-async event sequence."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from timeslice_verl.config.schema import TimesliceSettings
from timeslice_verl.hooks.events import (
    CheckpointEvent,
    Event,
    InitWorkersEvent,
    RolloutEvent,
    TrainStepEvent,
    WeightSyncEvent,
)
from timeslice_verl.hooks.spec import hook_names, hookimpl
from timeslice_verl.hooks.lifecycle import Lifecycle
from timeslice_verl.hooks.manager import TimesliceManager


class RecordingPlugin:
    """Implements every hook and records ``(hook, event)`` in :attr:`calls`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Event]] = []

    @property
    def names(self) -> list[str]:
        """Just the hook names, in call order."""
        return [name for name, _ in self.calls]

    def events(self, hook: str) -> list[Event]:
        return [event for name, event in self.calls if name == hook]

    def _record(self, hook: str, event: Event) -> None:
        self.calls.append((hook, event))


def _recorder(hook: str):
    def impl(self: RecordingPlugin, event: Event) -> None:
        self._record(hook, event)

    impl.__name__ = hook
    return hookimpl(impl)


for _hook in hook_names():
    setattr(RecordingPlugin, _hook, _recorder(_hook))


@dataclass
class FakeTrainer:
    """The attributes a fully-async trainer exposes to hooks (progress counters and metrics)."""

    global_steps: int = 0
    current_param_version: int = 0
    local_trigger_step: int = 1
    metrics: dict[str, Any] = field(default_factory=dict)


def make_lifecycle(
    *plugins: Any,
    settings: TimesliceSettings | None = None,
    trainer: Any = None,
    load_installed: bool = False,
    entry_points: Sequence[str] | None = (),
    bundled: Sequence[str] = (),
    adapter: str = "test",
) -> Lifecycle:
    """The real manager and dispatcher around ``plugins`` (registered in order).

    ``load_installed=True`` also loads what ``settings.plugins`` selects, as a trainer process
    would, of the installed entry-point plugins only those named in ``entry_points`` (a test loads
    only what it names; ``None``: every installed one), and of timeslice's bundled plugins only those
    named in ``bundled`` (``agent``, ``timeline``, ``metrics``): by default none, so a test reaches no
    agent and writes no timeline.
    """
    settings = settings or TimesliceSettings(job="test-job")
    manager = TimesliceManager()
    if load_installed:
        plugin_settings = settings.plugins
        if entry_points is not None and plugin_settings.enabled is None:
            plugin_settings = dataclasses.replace(plugin_settings, enabled=list(entry_points))
        manager.load(plugin_settings, bundled=bundled)
    for i, plugin in enumerate(plugins):
        manager.register(plugin, getattr(plugin, "name", None) or f"plugin-{i}")
    manager.check()
    return Lifecycle(settings, manager, trainer=trainer if trainer is not None else FakeTrainer(), adapter=adapter)


def fake_event_sequence(
    steps: int = 3,
    *,
    trigger_parameter_sync_step: int = 1,
    required_samples: int = 8,
    queue_wait_s: float = 0.5,
    save_at: Iterable[int] = (),
    crash_at: int | None = None,
) -> Iterator[tuple[str, type[Event], dict[str, Any], dict[str, int]]]:
    """What a fully-async trainer fires: ``(hook, event class, fields, trainer progress)`` tuples.

    init_workers begin/end, the pre-fit weight sync, then per step post_rollout, pre_train_step,
    weight_sync begin/end (synced on every ``trigger_parameter_sync_step``-th step), a save when
    the param version is in ``save_at``; ``crash_at`` ends the run with ``trainer_exception`` at
    that step.
    """
    version = 0
    progress = {"global_steps": 0, "current_param_version": 0, "local_trigger_step": 1}
    yield "init_workers_begin", InitWorkersEvent, {}, dict(progress)
    yield "init_workers_end", InitWorkersEvent, {"elapsed_s": 1.0}, dict(progress)
    yield "weight_sync_begin", WeightSyncEvent, {"initial": True}, dict(progress)
    yield "weight_sync_end", WeightSyncEvent, {"initial": True, "synced": True, "elapsed_s": 0.1}, dict(progress)
    local = 1
    for step in range(1, steps + 1):
        progress.update(global_steps=step, current_param_version=version, local_trigger_step=local)
        yield "post_rollout", RolloutEvent, {
            "samples": required_samples, "required_samples": required_samples, "queue_wait_s": queue_wait_s,
        }, dict(progress)
        yield "pre_train_step", TrainStepEvent, {"local_step": local, "samples": required_samples}, dict(progress)
        if crash_at == step:
            yield "trainer_exception", _ExceptionMarker, {"point": "fit"}, dict(progress)
            return
        synced = local == trigger_parameter_sync_step
        local = 1 if synced else local + 1
        if synced:
            version += 1
        progress.update(current_param_version=version, local_trigger_step=local)
        yield "weight_sync_begin", WeightSyncEvent, {}, dict(progress)
        save = synced and version in set(save_at)
        yield "weight_sync_end", WeightSyncEvent, {"synced": synced, "elapsed_s": 0.1, "save_follows": save}, dict(progress)
        if save:
            yield "save_checkpoint_begin", CheckpointEvent, {}, dict(progress)
            yield "save_checkpoint_end", CheckpointEvent, {"saved": True, "elapsed_s": 0.2}, dict(progress)


class _ExceptionMarker(Event):
    """Placeholder class in :func:`fake_event_sequence`; :func:`play` raises a real exception."""


def play(lifecycle: Lifecycle, sequence: Iterable[tuple[str, type[Event], dict[str, Any], dict[str, int]]]) -> None:
    """Fire ``sequence`` through ``lifecycle`` as a trainer would (start first, stop at the end)."""
    trainer = lifecycle.trainer
    reason = "finished"
    for hook, cls, fields, progress in sequence:
        for key, value in progress.items():
            if hasattr(trainer, key):
                setattr(trainer, key, value)
        if cls is _ExceptionMarker:
            lifecycle.report_exception(fields["point"], RuntimeError("scripted crash"))
            reason = "error"
            continue
        getattr(lifecycle, hook)(lifecycle.event(cls, **fields))  # the dispatcher's own method for the hook
    lifecycle.stop(reason)


__all__ = ["FakeTrainer", "RecordingPlugin", "fake_event_sequence", "make_lifecycle", "play"]
