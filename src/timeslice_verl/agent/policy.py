"""The arbitration policy: from what the agent knows now to the one move it makes next. Pure.

Rules (docs/architecture.md §5), in the order they are applied:

1. a job whose run ended and that holds nothing is forgotten, thawed first if it is frozen;
2. the GPU's desired owner is the job that holds it, else the head of the FIFO queue, else the job
   whose ``prepare`` expires first; with none, the tenant;
3. for a desired job: the tenant yields (a pause alone where memory allows: :mod:`~timeslice_verl.agent.tenant.hold`; a
   tenant so held is put to sleep when the trainer eats into the margin, or before a thaw that brings memory back),
   then any other idle running job is frozen, then the job is thawed (or recovered from a fault), then — if it is
   waiting — granted;
4. with no desired job: idle running jobs are frozen; a job whose freeze was refused keeps the GPU
   (the tenant sleeps on); an awake tenant that was just registered is warmed up (put to sleep and woken:
   :mod:`~timeslice_verl.agent.tenant.warmup`); otherwise a sleeping or faulted tenant is woken when there is room.

The reconciler in :mod:`timeslice_verl.agent.arbiter` asks for one move, makes it, and asks again,
so requests that arrive mid-transition are honoured at the next step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

RUNNING, TRANSITIONING, FROZEN, FAULTED = "RUNNING", "TRANSITIONING", "FROZEN", "FAULTED"
AWAKE, ASLEEP, DEAD, TENANT_FAULTED = "awake", "asleep", "dead", "faulted"


@dataclass(frozen=True)
class JobView:
    """What the policy needs to know about one job."""

    name: str
    state: str = RUNNING
    holding: bool = False
    queued: bool = False
    prepared_until: float = 0.0
    refused: bool = False
    """Its last freeze was refused: it keeps the GPU until its next release."""
    ending: bool = False
    has_pids: bool = True
    needs_room: bool = False
    """Its thaw brings memory back to the GPU (checkpointed or parked): a tenant held awake must sleep first."""


@dataclass(frozen=True)
class World:
    jobs: tuple[JobView, ...] = ()
    queue_head: str | None = None
    tenant: str = ""
    """The tenant's state (``awake``, ``asleep``, ``dead``, ``faulted``) or ``""`` without a tenant."""
    room_for_tenant: bool = True
    now: float = 0.0
    tenant_retry_at: float = 0.0
    """After a failed tenant move: not before this time (backoff)."""
    tenant_warm_up: bool = False
    """The tenant was registered and has not slept since: its warm-up is due."""
    tenant_held: bool = False
    """The tenant is paused but awake (a pause-only yield): its memory is on the GPU."""
    tenant_tight: bool = False
    """While it is held awake, the trainer ate into the margin beside it (:mod:`~timeslice_verl.agent.tenant.hold`)."""


class MoveKind(str, enum.Enum):
    """What a move does (a ``str``: it compares, formats and serialises as its value)."""

    forget = "forget"
    """An ended job that holds nothing is dropped."""
    thaw_ended = "thaw_ended"
    """An ended job still frozen is thawed (then forgotten)."""
    tenant_yield = "tenant_yield"
    """The tenant gives the GPU up (a pause alone where memory allows, else sleep)."""
    tenant_sleep = "tenant_sleep"
    """A tenant held awake is put to sleep (the trainer needs its memory)."""
    tenant_warm_up = "tenant_warm_up"
    """A tenant just registered is put to sleep and woken once, while nobody asks."""
    tenant_reclaim = "tenant_reclaim"
    """A sleeping or faulted tenant is woken: the GPU is its."""
    freeze = "freeze"
    thaw = "thaw"
    recover = "recover"
    """A faulted job is brought back to running."""
    grant = "grant"
    """A waiting running job is told it owns the GPU."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Move:
    kind: MoveKind
    job: str = ""
    waiting: bool = False
    """For ``thaw``/``recover``: the job is at the head of the queue (an acquire waits on it)."""


def desired(world: World) -> JobView | None:
    """The job that should own the GPU now, or None for the tenant."""
    for job in world.jobs:
        if job.holding:
            return job
    if world.queue_head is not None:
        return next((j for j in world.jobs if j.name == world.queue_head), None)
    prepared = [j for j in world.jobs if j.prepared_until > world.now]
    return min(prepared, key=lambda j: j.prepared_until) if prepared else None


def _idle_running(job: JobView) -> bool:
    return job.state == RUNNING and not job.holding and not job.refused


def next_move(world: World) -> Move | None:
    """The next move, or None when the GPU is where it should be."""
    for job in world.jobs:
        if job.ending and not job.holding and not job.queued:
            frozen = job.state in (FROZEN, FAULTED) and job.has_pids
            return Move(MoveKind.thaw_ended if frozen else MoveKind.forget, job.name)
    target = desired(world)
    if target is not None:
        if world.tenant == AWAKE:  # a faulted or dead tenant never makes the trainer wait
            return Move(MoveKind.tenant_yield)
        if world.tenant_held and (world.tenant_tight or (target.needs_room and target.state in (FROZEN, FAULTED))):
            return Move(MoveKind.tenant_sleep)
        for other in world.jobs:
            if other.name != target.name and _idle_running(other):
                return Move(MoveKind.freeze, other.name)
        waiting = world.queue_head == target.name
        if target.state == FROZEN:
            return Move(MoveKind.thaw, target.name, waiting=waiting)
        if target.state == FAULTED:
            return Move(MoveKind.recover, target.name, waiting=waiting)
        if target.state == RUNNING and waiting:
            return Move(MoveKind.grant, target.name)
        return None
    for job in world.jobs:
        if _idle_running(job):
            return Move(MoveKind.freeze, job.name)
    if any(job.refused and job.state == RUNNING for job in world.jobs):
        return None  # a job that could not be frozen is still on the GPU
    if world.tenant == AWAKE and world.tenant_warm_up:
        return Move(MoveKind.tenant_warm_up)
    if world.tenant in (ASLEEP, TENANT_FAULTED) and world.room_for_tenant and world.now >= world.tenant_retry_at:
        return Move(MoveKind.tenant_reclaim)
    return None
