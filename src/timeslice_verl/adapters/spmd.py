"""Time-slicing for SPMD trainers (torchrun, one process per GPU, several nodes): :class:`RankHandoff`.

verl's driver talks to the agent for all its workers; an SPMD trainer has no driver, so its ranks
share the work. Every rank parks (or, with ``swap=checkpoint``, only frees its caches) itself; one
rank per node — the node's *leader*, its lowest rank — is the client of that node's agent and
releases or acquires the node's GPUs for all its local ranks. The ranks agree over a CPU process
group (gloo): a release or acquire completes on every rank only when every node's agent did its
part, and a rank that fails or disappears makes every leader give its node's GPUs back (the job
ends: ``release(done)``) before the error propagates.

Never run a handoff with a GPU collective in flight: the agent locks every rank, and a rank blocked
in an NCCL kernel waiting for a locked peer would never finish its lock. Coordination therefore
goes over gloo, never NCCL.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.agent.protocol import SWAP_MODES
from timeslice_verl.log import get_logger
from timeslice_verl.names import valid_job
from timeslice_verl.park import Parker, parker

log = get_logger("adapter.spmd")


class RankLost(RuntimeError):
    """A rank or a node's agent failed during a handoff; every node's GPUs were given back."""


@dataclass
class Handoff:
    """One rank's view of one handoff (for benchmarks and logs)."""

    action: str
    seconds: float = 0.0
    agent_s: float = 0.0
    """The leader's call to its agent (0 on other ranks)."""
    park_s: float = 0.0
    parked: int = 0
    agent: dict[str, Any] = field(default_factory=dict)


class RankHandoff:
    """Release and acquire the GPUs of an SPMD job from every rank.

    ``socket_path``: the node's agent (default: where ``timeslice-verl agent`` listens by default).
    ``group``: a gloo process group over all ranks (None: a single process). ``node``: what tells
    nodes apart (default: the host name); ranks of one node must use the same agent socket.
    """

    def __init__(
        self, job: str, socket_path: str | None = None, *, swap: str = "park", group: Any = None,
        node: str | None = None, acquire_timeout_s: float | None = None, park: Parker | None = None,
    ) -> None:
        if swap not in SWAP_MODES:
            raise ValueError(f"swap {swap!r} is not one of {', '.join(SWAP_MODES)}")
        if not valid_job(job):
            raise ValueError(f"job {job!r} is not a job name (letters, digits, '.', '_', '-'; max 64)")
        if socket_path is None:
            from timeslice_verl.config import default_runtime_dir

            socket_path = str(default_runtime_dir() / "agent.sock")
        self.job, self.socket_path, self.swap, self.group = job, socket_path, swap, group
        self.node = node or socket.gethostname()
        self.acquire_timeout_s = acquire_timeout_s
        self.parker = park or parker()
        self.client: AgentClient | None = None
        self.local: list[int] = []
        """Ranks of this node (global rank numbers); the first is the leader."""
        self.pids: list[int] = []
        self.held = True  # a trainer starts on its GPU

    # ------------------------------------------------------------------ agreement

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def leader(self) -> bool:
        return bool(self.local) and self.local[0] == self.rank

    def _gather(self, item: Any) -> list[Any]:
        """Every rank's ``item``; a lost rank raises :class:`RankLost` after the GPUs were given back."""
        if self.group is None:
            return [item]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(out, item, group=self.group)
        except Exception as exc:  # a peer died or timed out
            self._give_back(f"a rank was lost ({exc})")
            raise RankLost(f"job {self.job}: a rank was lost during a handoff ({exc}); this node's GPUs were given "
                           "back") from exc
        return out

    def _agree(self, what: str, error: str) -> None:
        """Every rank says whether its part of ``what`` worked; all raise if any did not."""
        answers = self._gather((self.rank, error))
        failed = [(r, e) for r, e in answers if e]
        if failed:
            self._give_back(f"{what} failed on rank {failed[0][0]}")
            raise RankLost(f"job {self.job}: {what} failed on rank {failed[0][0]}: {failed[0][1]}")

    def _give_back(self, why: str) -> None:
        if self.leader and self.client is not None:
            try:
                self.client.release(self.job, done=True)
                log.error("job %s: %s; node %s's GPUs given back", self.job, why, self.node)
            except AgentError as exc:
                log.error("job %s: %s; could not give node %s's GPUs back: %s", self.job, why, self.node, exc)
        self.held = False

    # ------------------------------------------------------------------ the handoffs

    def start(self) -> None:
        """Find the node's ranks; the leader connects and registers them; parking ranks pin host RAM."""
        answers = self._gather((self.node, self.rank, os.getpid()))
        self.local = sorted(r for node, r, _ in answers if node == self.node)
        self.pids = sorted(pid for node, _, pid in answers if node == self.node)
        error = ""
        try:
            if self.swap != "checkpoint":
                self.parker.reserve()
            if self.leader:
                self.client = AgentClient(self.socket_path, client=f"spmd:{self.job}:{self.node}")
                self.client.register_pids(self.job, self.pids)
                self.client.acquire(self.job, timeout_s=self.acquire_timeout_s)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        self._agree("start", error)

    def release(self) -> Handoff:
        """Park (or free caches), then each node's leader releases its GPUs."""
        t0 = time.perf_counter()
        out = Handoff("release")
        report, error = None, ""
        try:
            if self.swap != "checkpoint":
                report = self.parker.park()
                out.park_s, out.parked = report.seconds, report.parked
            else:
                from timeslice_verl.adapters.workers import release_caches_here

                release_caches_here()
        except Exception as exc:
            error = f"park: {exc}"
        entry = {"pid": os.getpid(), "parked": report.parked if report else 0, "kept": report.kept if report else 0}
        reports = self._gather((self.node, entry, error))
        failed = [e for _, _, e in reports if e]
        if failed:  # nobody releases: whoever parked unparks, the job keeps its GPUs this valley
            self.parker.unpark()
            out.seconds = time.perf_counter() - t0
            log.error("job %s: park failed on a rank (%s): keeping the GPUs this valley", self.job, failed[0])
            return out
        error = ""
        if self.leader:
            assert self.client is not None
            t1 = time.perf_counter()
            try:
                parked = [r for node, r, _ in reports if node == self.node]
                if self.swap == "checkpoint":
                    out.agent = self.client.release(self.job)
                else:
                    out.agent = self.client.release(self.job, swap=self.swap, parked=parked)
            except AgentError as exc:
                error = str(exc)
            out.agent_s = time.perf_counter() - t1
        self._agree("release", error)
        self.held = False
        out.seconds = time.perf_counter() - t0
        return out

    def prepare(self) -> None:
        """The leader asks its agent to start bringing the GPUs back (no agreement needed: a hint)."""
        if self.leader and self.client is not None:
            try:
                self.client.prepare(self.job)
            except AgentError as exc:
                log.warning("job %s: prepare failed: %s", self.job, exc)

    def acquire(self) -> Handoff:
        """Each leader acquires its node's GPUs; once every node has them, every rank unparks."""
        t0 = time.perf_counter()
        out = Handoff("acquire")
        error = ""
        if self.leader:
            assert self.client is not None
            try:
                out.agent = self.client.acquire(self.job, timeout_s=self.acquire_timeout_s)
            except AgentError as exc:
                error = str(exc)
            out.agent_s = time.perf_counter() - t0
        self._agree("acquire", error)
        self.held = True
        try:
            report = self.parker.unpark()
        except Exception as exc:
            error = f"unpark: {exc}"
        else:
            out.park_s, out.parked = report.seconds, report.parked
        self._agree("unpark", error)
        out.seconds = time.perf_counter() - t0
        return out

    def close(self) -> None:
        """The run is over: every rank comes back from a park, leaders tell their agents the job ended."""
        if not self.held:
            self.acquire()
        if self.leader and self.client is not None:
            try:
                self.client.release(self.job, done=True)
            finally:
                self.client.close()
                self.client = None


__all__ = ["Handoff", "RankHandoff", "RankLost"]
