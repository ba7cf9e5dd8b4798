"""Time-slicing for SPMD trainers (torchrun, one process per GPU, several nodes): :class:`RankHandoff`.

verl's driver talks to the agent for all its workers; an SPMD trainer has no driver, so its ranks
share the work. Every rank parks (or, with ``swap=checkpoint``, only frees its caches) itself; one
rank per node — the node's *leader*, its lowest rank — is the client of that node's agent and
releases or acquires the node's GPUs for all its local ranks. The sequence itself is
:class:`timeslice_verl.handoff.Handoff`'s, the same as verl's; here are only the ranks
(:class:`GlooRanks`): they agree over a CPU process group (gloo). A release goes to the agents only once
every rank parked; after it the ranks say nothing more to each other (the agent may stop any of them at
any moment), so an agent that refuses a release only leaves its node's GPUs with the job for the valley.
An acquire completes on every rank only when every node's agent granted, and a rank that fails or
disappears makes every leader give its node's GPUs back (the job ends: ``release(done)``) before the
error propagates.

Never run a handoff with a GPU collective in flight: the agent locks every rank, and a rank blocked
in an NCCL kernel waiting for a locked peer would never finish its lock. Coordination therefore
goes over gloo, never NCCL.

With ``settings`` (:meth:`RankHandoff.from_settings`), each leader also fires the ``handoff`` event
to the timeline and metrics plugins, as verl's trainer does.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.config.schema import default_socket
from timeslice_verl.handoff.options import HandoffOptions
from timeslice_verl.handoff.ranks import RankLost
from timeslice_verl.handoff.sequence import Handoff, HandoffFigures, handoff_event
from timeslice_verl.log import get_logger
from timeslice_verl.names import SwapMode, swap_setting, valid_job
from timeslice_verl.ranks.park import Parker, parker

log = get_logger("adapter.spmd")


class GlooRanks:
    """This rank's parker and its peers, reached over a gloo group (None: a single process)."""

    collective = True
    """Each rank runs the handoff itself; what the agent did is agreed over gloo."""

    def __init__(self, job: str, group: Any, node: str, park: Parker) -> None:
        self.job, self.group, self.node, self.parker = job, group, node, park
        self.local: list[int] = []
        """Ranks of this node (global rank numbers); the first is the leader."""
        self.pids: list[int] = []
        self.give_back: Callable[[str], None] = lambda why: None
        """What a rank does before :class:`RankLost` propagates (the leader releases with ``done``)."""

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def leader(self) -> bool:
        return bool(self.local) and self.local[0] == self.rank

    def gather(self, item: Any) -> list[Any]:
        """Every rank's ``item``; a lost rank raises :class:`RankLost` after the GPUs were given back."""
        if self.group is None:
            return [item]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(out, item, group=self.group)
        except Exception as exc:  # a peer died or timed out
            self.give_back(f"a rank was lost ({exc})")
            raise RankLost(f"job {self.job}: a rank was lost during a handoff ({exc}); this node's GPUs were given "
                           "back") from exc
        return out

    def find_node(self) -> None:
        answers = self.gather((self.node, self.rank, os.getpid()))
        self.local = sorted(r for node, r, _ in answers if node == self.node)
        self.pids = sorted(pid for node, _, pid in answers if node == self.node)

    def shared(self, value: Any) -> Any:
        """The first rank's ``value`` on every rank (a release's decision: every rank skips or lends alike)."""
        return self.gather(value)[0]

    def agree(self, what: str, error: BaseException | None) -> None:
        """Every rank says whether its part of ``what`` worked; all raise if any did not."""
        answers = self.gather((self.rank, f"{type(error).__name__}: {error}" if error is not None else ""))
        failed = [(r, e) for r, e in answers if e]
        if failed:
            self.give_back(f"{what} failed on rank {failed[0][0]}")
            raise RankLost(f"job {self.job}: {what} failed on rank {failed[0][0]}: {failed[0][1]}")

    def _each(self, action: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
        """Run ``action`` here; this node's reports, or an error naming the first rank that failed (anywhere)."""
        report, error = None, ""
        try:
            report = action()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        answers = self.gather((self.node, self.rank, report, error))
        failed = [(r, e) for _, r, _, e in answers if e]
        if failed:
            raise RuntimeError(f"rank {failed[0][0]}: {failed[0][1]}")
        return [rep for node, _, rep, _ in answers if node == self.node]

    def can_park(self) -> bool:
        return True

    def park_reserve(self) -> list[dict[str, Any]]:
        return self._each(lambda: self.parker.reserve().to_dict())

    def park(self) -> list[dict[str, Any]]:
        return self._each(lambda: self.parker.park().to_dict())

    def unpark(self) -> list[dict[str, Any]]:
        return self._each(lambda: self.parker.unpark().to_dict())

    def release_caches(self) -> list[dict[str, Any]]:
        from timeslice_verl.ranks.worker import release_caches_here

        return self._each(release_caches_here)

    def local_pids(self) -> list[int]:
        return list(self.pids)


class RankHandoff:
    """Release and acquire the GPUs of an SPMD job from every rank.

    ``socket_path``: the node's agent (default: where ``timeslice-verl agent`` listens by default).
    ``group``: a gloo process group over all ranks (None: a single process). ``node``: what tells
    nodes apart (default: the host name); ranks of one node must use the same agent socket.
    ``options``: the handoff's settings (:meth:`from_settings` reads them off a ``timeslice`` section; the
    keyword arguments override single ones). ``backlog``: ``() -> (queued, required)`` samples for the next step,
    if the trainer has a queue (without one the valleys' own lengths are the forecast). ``report``: receives each
    handoff's figures on every rank (the leader's carry the agent's reply).
    """

    def __init__(
        self, job: str, socket_path: str | None = None, *, swap: str | None = None, group: Any = None,
        node: str | None = None, acquire_timeout_s: float | None = None, park: Parker | None = None,
        prepare_lead_s: float | None = None, options: HandoffOptions | None = None,
        backlog: Callable[[], Any] | None = None, report: Callable[[HandoffFigures], None] | None = None,
    ) -> None:
        if not valid_job(job):
            raise ValueError(f"job {job!r} is not a job name (letters, digits, '.', '_', '-'; max 64)")
        self.socket_path = socket_path or str(default_socket())
        self.ranks = GlooRanks(job, group, node or socket.gethostname(), park or parker())
        self.ranks.give_back = self._give_back
        given = {k: v for k, v in (("swap", swap), ("acquire_timeout_s", acquire_timeout_s),
                                   ("prepare_lead_s", prepare_lead_s)) if v is not None}
        options = HandoffOptions(**{**(options or HandoffOptions(swap=SwapMode.park)).__dict__, **given})
        self.handoff = Handoff(job, client=None, ranks=self.ranks, options=options, report=report, backlog=backlog)
        self.lifecycle: Any = None

    @classmethod
    def from_settings(cls, settings: Any, *, group: Any = None, node: str | None = None,
                      backlog: Callable[[], Any] | None = None) -> RankHandoff:
        """A RankHandoff configured by a ``timeslice`` section (job, socket, every ``handoff`` key), whose leaders
        fire ``handoff`` events to the section's plugins (the agent plugin excepted: the RankHandoff is the
        agent's client)."""
        from dataclasses import replace

        from timeslice_verl.config.schema import socket_path
        from timeslice_verl.hooks.lifecycle import Lifecycle

        plugins = replace(settings.plugins, disabled=sorted({*settings.plugins.disabled, "agent"}))
        lifecycle = Lifecycle.build(replace(settings, plugins=plugins), adapter="spmd")

        def report(figures: HandoffFigures) -> None:
            if handoff.leader:  # one timeline per node
                lifecycle.handoff(handoff_event(lifecycle, figures))

        handoff = cls(settings.job, str(socket_path(settings)), group=group, node=node, backlog=backlog, report=report,
                      options=HandoffOptions.from_settings(settings))
        handoff.lifecycle = lifecycle
        return handoff

    # ------------------------------------------------------------------ what callers read

    @property
    def job(self) -> str:
        return self.handoff.job

    @property
    def swap(self) -> SwapMode | None:
        return self.handoff.swap

    @swap.setter
    def swap(self, value: SwapMode | str | None) -> None:
        self.handoff.swap = swap_setting(value)

    @property
    def parker(self) -> Parker:
        return self.ranks.parker

    @property
    def leader(self) -> bool:
        return self.ranks.leader

    @property
    def held(self) -> bool:
        return self.handoff.held

    @property
    def client(self) -> AgentClient | None:
        return self.handoff.client

    def _give_back(self, why: str) -> None:
        client = self.handoff.client
        if self.leader and client is not None:
            try:
                client.release(self.job, done=True)
                log.error("job %s: %s; node %s's GPUs given back", self.job, why, self.ranks.node)
            except AgentError as exc:
                log.error("job %s: %s; could not give node %s's GPUs back: %s", self.job, why, self.ranks.node, exc)
        self.handoff.held = self.handoff.granted = False

    # ------------------------------------------------------------------ the handoffs

    def start(self) -> None:
        """Find the node's ranks; each leader connects and acquires its node's GPUs; parking ranks pin
        host RAM and each leader registers its node's pids."""
        self.ranks.find_node()
        if self.leader:
            self.handoff.client = AgentClient(self.socket_path, client=f"spmd:{self.job}:{self.ranks.node}")
        self.handoff.held = self.handoff.granted = False
        self.handoff.acquire("start")  # every rank agrees that every node's agent granted
        try:
            self.handoff.begin()
        except RankLost:
            raise
        except Exception as exc:  # a rank that cannot pin cannot park: every node gives its GPUs back
            self._give_back(f"start failed ({exc})")
            raise RankLost(f"job {self.job}: start failed: {exc}") from exc

    def release(self) -> HandoffFigures:
        """Park (or free caches), then each node's leader releases its GPUs."""
        return self.handoff.release("release") or HandoffFigures("release", "release")

    def prepare(self) -> None:
        """The leader asks its agent to start bringing the GPUs back (a hint: nothing to agree on)."""
        self.handoff.prepare("trainer")

    def acquire(self) -> HandoffFigures:
        """Each leader acquires its node's GPUs; once every node has them, every rank unparks."""
        return self.handoff.acquire("acquire") or HandoffFigures("acquire", "acquire")

    def close(self) -> None:
        """The run is over: every rank comes back from a park, leaders tell their agents the job ended."""
        self.handoff.done("close")
        self.handoff.close()
        if self.lifecycle is not None and self.leader:
            self.lifecycle.stop()


__all__ = ["GlooRanks", "RankHandoff", "RankLost"]
