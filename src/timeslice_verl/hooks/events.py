"""Small frozen records that travel with every lifecycle hook call.

Hooks receive them as the ``event`` keyword. They are immutable so one plugin cannot change what
the next one sees, and they serialise to flat dicts (``to_dict``) for the timeline and the logs.
Times are wall-clock seconds (``time.time()``) so records from the trainer and the agent of one
node line up on one axis.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    """What every event carries: whose job, where the trainer is, and when."""

    job: str
    step: int = 0
    """The trainer's ``global_steps`` when the event fired."""
    param_version: int = 0
    """The trainer's ``current_param_version`` (bumped on every weight sync)."""
    time: float = field(default_factory=time.time)

    kind: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, BaseException):
                continue
            if isinstance(value, tuple):
                value = [v.to_dict() if hasattr(v, "to_dict") else v for v in value]
            out[f.name] = value
        return out


@dataclass(frozen=True)
class RunEvent(Event):
    """Start and stop of time-slicing in this trainer process."""

    adapter: str = ""
    """``stock``, ``v1`` or ``hooked``: which verl adapter fired the events."""
    reason: str = ""
    """At stop: ``finished`` or ``error``."""

    kind: ClassVar[str] = "run"


@dataclass(frozen=True)
class InitWorkersEvent(Event):
    """Worker groups are created and models loaded onto the trainer's GPUs."""

    elapsed_s: float | None = None
    """At the end: how long ``init_workers`` took."""

    kind: ClassVar[str] = "init_workers"


@dataclass(frozen=True)
class RolloutEvent(Event):
    """A batch of rollout samples was dequeued and assembled."""

    samples: int = 0
    required_samples: int = 0
    queue_wait_s: float = 0.0
    """How long the trainer waited on the message queue for this batch."""

    kind: ClassVar[str] = "rollout"


@dataclass(frozen=True)
class TrainStepEvent(Event):
    """The training step is about to touch the GPU."""

    local_step: int = 1
    """``local_trigger_step``: 1..trigger_parameter_sync_step within one sync cycle."""
    samples: int = 0

    kind: ClassVar[str] = "train_step"


@dataclass(frozen=True)
class WeightSyncEvent(Event):
    """New weights are pushed to the rollout engines (or the call was a no-op)."""

    initial: bool = False
    """The pre-fit sync ``fully_async_main`` runs before ``fit()``."""
    synced: bool | None = None
    """At the end: whether weights were actually pushed (None at the begin)."""
    elapsed_s: float | None = None
    save_follows: bool = False
    """At the end: a model save is due later in this step, so the trainer still needs its GPU."""
    pushed_bytes: int | None = None
    """At the end: the bytes the checkpoint engine pushed, where it reports them (``timeslice_ipc`` does)."""
    push_s: float | None = None
    """At the end: the engine's seconds from its first tensor to the receivers' last acknowledgement."""

    kind: ClassVar[str] = "weight_sync"


@dataclass(frozen=True)
class CheckpointEvent(Event):
    """A checkpoint save of the trainer's models."""

    force: bool = False
    saved: bool | None = None
    """At the end: whether the save ran (False when a plugin vetoed it)."""
    elapsed_s: float | None = None

    kind: ClassVar[str] = "checkpoint"


@dataclass(frozen=True)
class ExceptionEvent(Event):
    """An error escaped the trainer. Fired once per exception object."""

    point: str = ""
    """Where it escaped: ``init_workers``, ``update_weights``, ``fit``…"""
    error_type: str = ""
    message: str = ""
    error: BaseException | None = field(default=None, compare=False, repr=False)

    kind: ClassVar[str] = "exception"


@dataclass(frozen=True)
class Transition:
    """One move of the GPU, as the agent performed it."""

    action: str
    """``freeze``/``thaw`` (a trainer job) or ``tenant_yield``/``tenant_reclaim`` (vLLM)."""
    subject: str
    start: float
    end: float
    ok: bool = True
    bytes: int = 0
    detail: str = ""
    phases: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    """Seconds per step (``lock``, ``checkpoint``, ``restore``, ``unlock``…) where known."""
    left: int = 0
    """``freeze``: GPU bytes the job's processes still use after it (NVML; 0 without it). A frozen
    process cannot measure this itself: NVML calls from a locked process block until it is unlocked."""

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transition:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class HandoffEvent(Event):
    """The trainer's side of a GPU handoff: an acquire, release or prepare sent to the agent."""

    action: str = ""
    """``acquire``, ``release``, ``skip`` (a release that could not pay), ``prepare`` or ``crash_release``."""
    point: str = ""
    """The lifecycle hook that caused it (``pre_train_step``…)."""
    waited_s: float = 0.0
    """How long the call blocked the trainer."""
    ok: bool = True
    detail: str = ""
    transitions: tuple[Transition, ...] = ()
    """The agent's moves since the previous handoff of this job."""
    live_bytes: int = 0
    """Release: GPU bytes the trainer's tensors hold (what a freeze must move at least), over ranks."""
    reserved_before: int = 0
    """Release: the allocators' reserved bytes before the workers freed their caches."""
    reserved_after: int = 0
    """Release: the same after freeing (the rest of the difference to a freeze's bytes is context and
    library workspaces)."""
    swap: str = ""
    """Release: how the job's memory leaves the GPU (``resident``, ``park``, ``checkpoint``…); acquire: ``park`` or
    ``park+checkpoint`` when the workers unparked themselves."""
    parked_bytes: int = 0
    """Bytes the workers parked in (release) or brought back from (acquire) pinned host RAM, over ranks."""
    park_s: float = 0.0
    """The slowest rank's park or unpark, seconds (the trainer waited for it)."""
    early_s: float = 0.0
    """An acquire prepared ahead of need: how long the GPUs were back before the trainer asked."""

    kind: ClassVar[str] = "handoff"

    @property
    def thaw_s(self) -> float:
        """The agent's thaws in this handoff (unlock, and restore where the job was checkpointed)."""
        return sum(t.seconds for t in self.transitions if t.action == "thaw")

    @property
    def freeze_s(self) -> float:
        return sum(t.seconds for t in self.transitions if t.action == "freeze")


@dataclass(frozen=True)
class ValidationEvent(Event):
    """One validation run in the valleys ended (``timeslice.validate``): its version's weights pushed into the policy
    tenant, the validation set answered and scored — or why not."""

    version: int = 0
    """The weight version validated (``param_version`` is the trainer's when the run ended: later)."""
    batch_id: str = ""
    status: str = ""
    """The run's batch: ``completed``, ``failed``, ``cancelled`` … (empty: it never started)."""
    answers: int = 0
    push_s: float = 0.0
    seconds: float = 0.0
    """From the push's start to the metrics."""
    late: int = 0
    """Runs reported late so far (a run still under way, or held, when a newer version was due)."""
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    """verl's validation metrics (``val-core/…``), as logged at the version's step."""

    kind: ClassVar[str] = "validation"


STARTUP_POINT = "init_workers_begin"
"""The acquire before verl loads the model: start-up, not a valley, so no trainer wait."""
PREPARE_POINT = "prepare"
"""The acquire the way back makes ahead of need, in the background: nobody waits on it."""


def is_trainer_wait(record: dict[str, Any]) -> bool:
    """An acquire that blocked the running trainer: every acquire after start-up (the training step's,
    and the ones a weight sync or a save make). The one definition of "trainer wait", for the summary,
    the metrics plugin and the benchmarks."""
    return (record.get("hook", "handoff") == "handoff" and record.get("action") == "acquire"
            and record.get("ok", True) and record.get("point") not in (STARTUP_POINT, PREPARE_POINT))
