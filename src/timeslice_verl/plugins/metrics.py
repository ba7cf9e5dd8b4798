"""The metrics plugin: handoff figures into the trainer's metrics dict, per training step.

verl's fully-async trainer collects ``trainer.metrics`` during a step and hands it to its tracking
backends (console, wandb, tensorboard…), so these keys show up next to verl's own. The agent's
Prometheus endpoint (``timeslice.agent.metrics_port``) covers the node-level view.

Keys (prefix ``timeslice.metrics.prefix``, default ``timeslice/``): ``acquire_wait_s``,
``freeze_s`` and ``thaw_s`` (the agent's whole moves), ``checkpoint_gbps`` and ``restore_gbps`` (the
CUDA driver's byte rates, when it moved bytes), ``frozen_gib``, ``tenant_yield_s``, ``tenant_reclaim_s``,
``handoffs``, ``skipped`` (1 in a step whose release could not pay), ``way_back_early_s`` (a prepared
acquire: how long the GPUs were back before the trainer asked); with a park swap mode also ``park_s``,
``unpark_s`` and ``parked_gib``. The names follow
the glossary of docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

from timeslice_verl.hooks.events import HandoffEvent, is_trainer_wait
from timeslice_verl.hooks.spec import hookimpl


class MetricsPlugin:
    name = "metrics"

    def __init__(self) -> None:
        self.prefix = "timeslice/"
        self.handoffs = 0

    @hookimpl
    def timeslice_start(self, lifecycle: Any) -> None:
        self.prefix = lifecycle.settings.metrics.prefix

    @staticmethod
    def figures(event: HandoffEvent) -> dict[str, float]:
        out: dict[str, float] = {}
        if is_trainer_wait(event.to_dict()):
            out["acquire_wait_s"] = event.waited_s  # the trainer wait (events.is_trainer_wait)
        if event.action == "skip":
            out["skipped"] = 1.0
        if event.early_s:
            out["way_back_early_s"] = event.early_s
        for t in event.transitions:
            if not t.ok:
                continue
            key = {"thaw": "thaw", "freeze": "freeze", "tenant_yield": "tenant_yield", "tenant_reclaim": "tenant_reclaim"}.get(t.action)
            if key is None:
                continue
            out[f"{key}_s"] = out.get(f"{key}_s", 0.0) + t.seconds
            if t.action not in ("thaw", "freeze"):
                continue
            # the driver's byte-moving step; 0 after a park, where the agent only locked and unlocked
            call = "checkpoint" if t.action == "freeze" else "restore"
            moving = t.phases.get(call, t.seconds)
            if t.bytes and moving > 0:
                out[f"{call}_gbps"] = t.bytes / 1e9 / moving
            if t.action == "freeze":
                out["frozen_gib"] = t.bytes / 2**30 if moving > 0 else 0.0
        if event.parked_bytes:
            out["park_s" if event.action in ("release", "crash_release") else "unpark_s"] = event.park_s
            out["parked_gib"] = event.parked_bytes / 2**30
        return out

    @hookimpl
    def handoff(self, trainer: Any, event: HandoffEvent) -> None:
        self.handoffs += 1
        metrics = getattr(trainer, "metrics", None)
        if not isinstance(metrics, dict):
            return
        for key, value in self.figures(event).items():
            metrics[self.prefix + key] = round(float(value), 6)
        metrics[self.prefix + "handoffs"] = self.handoffs
