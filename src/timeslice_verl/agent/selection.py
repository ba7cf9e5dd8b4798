"""Which of a job's processes a freeze touches: the trainer's ranks, never the rest of the job. Pure.

``TIMESLICE_JOB`` reaches every Ray actor of a verl run through its ``runtime_env``: the trainer's ranks
(``ray::WorkerDict``), but also verl's rollouter, its vLLM server and engine processes and the rollout side's
``ray::CheckpointEngineWorker``. Where trainer and rollouter share a GPU, freezing the tag would stop the rollout
with the trainer. The trainer's driver registers its ranks' pids with the agent (``register_pids``, at the
handoff's start, before its first release); once a job has registered ranks the agent may freeze, only those
are frozen and every other tagged process is left running. A job that registered none (one found by its tag
alone, a driver whose registration failed, or an SPMD rank that registered itself, a client the agent's CPU
backend must not stop) has its tagged processes frozen, except those whose process title names the rollout
side, so a lost registration never stops a rollouter sharing the GPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable


class Left(str, enum.Enum):
    """Why a process of the job is not frozen."""

    CLIENT = "a client of the agent (a stopped client could not ask for the GPU back)"
    OTHER_USER = "tagged for the job but owned by another user"
    OFF_GPU = "not on the agent's GPUs (NVML)"
    NOT_A_RANK = "tagged for the job but not one of the trainer ranks it registered"
    ROLLOUT = "tagged for the job, which registered no rank, and its title names verl's rollout side"

    def __str__(self) -> str:
        return str(self.value)


ROLLOUT_ACTORS = frozenset({"FullyAsyncRollouter", "vLLMHttpServer", "SGLangHttpServer", "TRTLLMHttpServer",
                            "CheckpointEngineWorker"})
"""Ray actor classes of verl's rollout side (titled ``ray::<class>`` or ``ray::<class>.<method>``)."""
ROLLOUT_PREFIXES = ("VLLM::", "sglang::")
"""Titles inference engines give their own processes (vLLM's ``VLLM::EngineCore``, ``VLLM::Worker``…)."""


def rollout_title(title: str) -> bool:
    """Whether a process title names verl's rollout side or an inference engine's process."""
    if title.startswith(ROLLOUT_PREFIXES):
        return True
    if not title.startswith("ray::"):
        return False
    words = title[len("ray::"):].split(maxsplit=1)
    return bool(words) and words[0].split(".", 1)[0] in ROLLOUT_ACTORS


@dataclass(frozen=True)
class Candidate:
    """One process of the job as the agent sees it (read from ``/proc`` and NVML by the caller)."""

    pid: int
    title: str = ""
    """Its command line (``ray::WorkerDict``, ``VLLM::EngineCore``…): for the logs and the no-registration guard."""
    registered: bool = False
    """A trainer rank the job's client registered."""
    tagged: bool = True
    owner_ok: bool = True
    """Owned by the job's user (checked for tagged processes; a registered one was checked at registration)."""
    on_gpu: bool = True
    """On the agent's GPUs, or no GPU filter applies (a backend that frees no GPU memory, ``freeze_off_gpu``)."""
    client: bool = False
    """The agent itself or a connected client it must never stop."""


@dataclass(frozen=True)
class Selection:
    freeze: tuple[int, ...]
    left: tuple[tuple[Candidate, Left], ...]


def select(candidates: Iterable[Candidate]) -> Selection:
    """The pids to freeze and, for every other candidate, why it is left running."""
    candidates = sorted(candidates, key=lambda c: c.pid)
    ranks_known = any(c.registered and not c.client for c in candidates)
    freeze: list[int] = []
    left: list[tuple[Candidate, Left]] = []
    for c in candidates:
        why = _why_left(c, ranks_known)
        if why is None:
            freeze.append(c.pid)
        else:
            left.append((c, why))
    return Selection(tuple(freeze), tuple(left))


def _why_left(c: Candidate, ranks_known: bool) -> Left | None:
    if c.client:
        return Left.CLIENT
    if not c.registered and not c.owner_ok:
        return Left.OTHER_USER
    if not c.on_gpu:
        return Left.OFF_GPU
    if c.registered:
        return None
    if ranks_known:
        return Left.NOT_A_RANK
    return Left.ROLLOUT if rollout_title(c.title) else None


__all__ = ["Candidate", "Left", "ROLLOUT_ACTORS", "Selection", "rollout_title", "select"]
