"""The trainer side of a GPU handoff, written once: :class:`Handoff`.

Every trainer that lends its GPUs — verl's driver through the agent plugin, an SPMD trainer through
:class:`~timeslice_verl.adapters.spmd.RankHandoff` — runs the same sequence:

* **release**: every rank parks its tensors (or, with ``swap=checkpoint``, frees its caches), then the
  agent's client releases the job (with the ranks' park reports); a rank that cannot park makes every
  rank unpark, and the job keeps its GPUs for that valley;
* **skip**: a release that cannot pay is not made (:mod:`~timeslice_verl.valley`);
* **prepare**: the way back ahead of need (:mod:`~timeslice_verl.wayback`), in the background;
* **acquire**: the agent grants the GPUs (it woke nothing, yielded the tenant, unlocked and restored the
  processes), then every rank unparks — unless the way back already did;
* **crash** / **done**: the GPUs come back and every rank unparks before the final release, so no rank
  is ever left without its tensors; the agent forgets a job released with ``done``.

What differs between trainers lives behind :class:`Ranks` (verl's worker groups, or torchrun ranks that
agree over gloo) and the client (one node's agent, or every node's: :mod:`~timeslice_verl.node_agents`).
Each handoff is reported as a :class:`HandoffFigures` record to a callback (the agent plugin turns it into a
``handoff`` event for the timeline and metrics plugins).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.names import SWAP_MODES
from timeslice_verl.swap_choice import choose
from timeslice_verl.handoff_figures import HandoffFigures, _park_entries, handoff_event, summarize
from timeslice_verl.log import get_logger
from timeslice_verl.valley import MARGIN, PreparePlanner, ValleyForecast
from timeslice_verl.wayback import WayBack

log = get_logger("handoff")

FINAL_ACQUIRE_TIMEOUT_S = 120.0
"""How long a crash or the end of the run waits to get the GPUs back before unparking (the step lock of
an agent that is restoring another job can take that long)."""


class RankLost(RuntimeError):
    """A rank or a node's agent failed during a handoff; every node's GPUs were given back."""


class Ranks(Protocol):
    """The trainer's GPU processes as a handoff sees them (one report dict per process)."""

    def can_park(self) -> bool: ...

    def park_reserve(self) -> list[dict[str, Any]]: ...

    def park(self) -> list[dict[str, Any]]:
        """Every rank parks; raises if any rank could not (the others may have parked)."""

    def unpark(self) -> list[dict[str, Any]]: ...

    def release_caches(self) -> list[dict[str, Any]]: ...

    def local_pids(self) -> list[int]: ...

    def agree(self, what: str, error: BaseException | None) -> None:
        """Every rank learns whether the agent's part of ``what`` worked; raises if it did not.
        Optional: ranks that one process drives (verl's worker groups) need no agreement."""


class Handoff:
    """One job's handoffs on this node: the agent connection (``client``: None on ranks that only
    follow), the ranks, the swap mode, the valley forecast and the way back.

    ``report`` receives every handoff's figures. ``held`` starts True: a trainer starts on its GPU.
    """

    def __init__(
        self, job: str, *, client: AgentClient | None, ranks: Ranks | None, swap: str = "checkpoint",
        acquire_timeout_s: float | None = None, prepare: bool = True, prepare_lead_s: float = 0.0,
        report: Callable[[HandoffFigures], None] | None = None,
        backlog: Callable[[], tuple[int, int]] | None = None, break_even_margin: float = MARGIN,
    ) -> None:
        if swap not in (*SWAP_MODES, "auto"):
            raise ValueError(f"swap {swap!r} is not one of {', '.join(SWAP_MODES)} or auto")
        swap = "checkpoint" if swap == "auto" and ranks is None else swap  # nothing could park
        if swap not in ("checkpoint", "auto") and ranks is None:
            raise ValueError(f"swap {swap} needs trainer ranks that can park their tensors (verl's worker groups, "
                             "or a RankHandoff in an SPMD trainer); this trainer has none: use swap=checkpoint")
        self.job, self.client, self.ranks, self.swap = job, client, ranks, swap
        self.acquire_timeout_s = acquire_timeout_s or None
        self.prepare_enabled = prepare
        self.planner = ValleyForecast(lead_s=prepare_lead_s, margin=break_even_margin)
        self.backlog_source = backlog
        """(queued, required) samples for the next step, read off verl; None for trainers without a queue."""
        self.report = report or (lambda figures: None)
        self.held = True
        self.parked = False
        """The ranks' tensors are in pinned host RAM (released with a park swap, not yet unparked)."""
        self._way_back = WayBack(self.planner, self._backlog, self._bring_back)
        self._prepared_at: float | None = None
        """When the way back ahead of need got the GPUs back (the trainer had not asked yet)."""
        self._last_release_s = 0.0

    # ------------------------------------------------------------------ set-up

    def begin(self) -> list[dict[str, Any]]:
        """After the model is loaded: pin the host buffers for parking (slow: never in a handoff) and
        register the ranks' pids with the agent. The pin reports, one per rank."""
        pinned: list[dict[str, Any]] = []
        if self.ranks is None:
            return pinned
        if self.swap == "auto":
            self.swap = self._pick_swap()
        if self.swap != "checkpoint" and not self.ranks.can_park():
            log.error("[timeslice] job=%s swap=%s but the ranks have no park method (is timeslice-verl installed where "
                      "the workers run?): swapping by checkpoint instead", self.job, self.swap)
            self.swap = "checkpoint"
        if self.swap != "checkpoint":
            t0 = time.perf_counter()
            pinned = self.ranks.park_reserve()
            log.info("[timeslice] job=%s pinned %.2f GiB of host RAM for parking on %d rank(s) in %.1f s", self.job,
                     sum(int(r.get("pinned", 0)) for r in pinned) / 2**30, len(pinned), time.perf_counter() - t0)
        if hasattr(self.client, "register_ranks"):  # across nodes: each node's agent gets its own ranks' pids
            self.client.register_ranks(self.job, self.ranks)  # type: ignore[union-attr]
            return pinned
        pids = self.ranks.local_pids()
        if pids and self.client is not None:
            try:
                self.client.register_pids(self.job, pids)
                log.info("[timeslice] job=%s registered worker pids %s", self.job, pids)
            except AgentError as exc:
                log.warning("[timeslice] job=%s could not register worker pids %s: %s (tag discovery still applies)",
                            self.job, pids, exc)
        return pinned

    def _pick_swap(self) -> str:
        """``swap=auto``: what every host of the ranks can afford (:func:`~timeslice_verl.swap_choice.choose`)."""
        assert self.ranks is not None
        try:
            reports = self.ranks.release_caches() if self.ranks.can_park() else None
        except RankLost:
            raise
        except Exception as exc:
            log.warning("[timeslice] job=%s swap=auto: the ranks' memory is unknown: %s", self.job, exc)
            reports = []
        swap, why = choose(reports)
        log.log(logging.INFO if swap == "park" else logging.WARNING, "[timeslice] job=%s swap=auto: %s (%s)", self.job, swap, why)
        return swap

    # ------------------------------------------------------------------ acquire

    def acquire(self, point: str, *, timeout_s: float | None = None) -> HandoffFigures | None:
        """Block until the job owns its GPUs and every rank has its tensors; None when it already did.
        An agent that refuses raises (the trainer never trains without its GPU). ``timeout_s``: instead
        of ``acquire_timeout_s``."""
        t0 = time.perf_counter()
        self.cancel_prepare()  # joins a way back under way
        if isinstance(self._way_back.error, RankLost):
            raise self._way_back.error
        if self.held:
            if self.parked:  # a park that failed half-way left ranks parked: they need their tensors now
                self._unpark()
            if self._prepared_at is None:
                return None
            out = HandoffFigures("acquire", point, seconds=time.perf_counter() - t0, detail="prepared ahead of need",
                                 early_s=max(0.0, time.monotonic() - self._prepared_at - (time.perf_counter() - t0)))
            self._prepared_at = None
            self.report(out)
            return out
        return self._acquire_now(point, t0, timeout_s=timeout_s)

    def _acquire_now(self, point: str, t0: float, *, timeout_s: float | None = None) -> HandoffFigures:
        out = HandoffFigures("acquire", point)
        error: BaseException | None = None
        if self.client is not None:
            try:
                out.agent = self.client.acquire(self.job, timeout_s=timeout_s or self.acquire_timeout_s)
            except AgentError as exc:
                error = exc
            out.agent_s = time.perf_counter() - t0
        self._agree("acquire", error)
        self.held = True
        if self.parked:  # after the agent unlocked (and restored) the ranks
            out.park, out.swap = self._unpark(), self.swap
        out.seconds = time.perf_counter() - t0
        if out.agent.get("thawed"):
            moves = {a: sum(t["end"] - t["start"] for t in out.agent.get("transitions", []) if t["action"] == a)
                     for a in ("freeze", "thaw", "tenant_yield", "tenant_reclaim")}
            self.planner.observe_thaw(moves["thaw"] + moves["tenant_yield"] + out.park_s)
            self.planner.observe_round_trip(self._last_release_s + sum(moves.values()) + out.park_s)
        log.info("[timeslice] job=%s ACQUIRE at=%s waited=%.0fms thawed=%s thaw=%.0fms frozen=%.2fGiB", self.job,
                 point, out.seconds * 1e3, bool(out.agent.get("thawed")), float(out.agent.get("thaw_s", 0)) * 1e3,
                 out.agent.get("frozen_bytes", 0) / 2**30)
        self.report(out)
        return out

    def _unpark(self) -> list[dict[str, Any]]:
        assert self.ranks is not None
        error: BaseException | None = None
        reports: list[dict[str, Any]] = []
        try:
            reports = self.ranks.unpark()
            self.parked = False
        except RankLost:
            raise
        except Exception as exc:
            error = exc
        self._agree("unpark", error)
        return reports

    def _agree(self, what: str, error: BaseException | None) -> None:
        agree = getattr(self.ranks, "agree", None)  # ranks without it are driven by this one process
        if agree is not None:
            agree(what, error)
        elif error is not None:
            raise error

    # ------------------------------------------------------------------ release

    def release(self, point: str, *, force: bool = False) -> HandoffFigures | None:
        """Park (or free caches), then give the GPUs to the agent. A failed park keeps them this valley;
        a failed agent call is logged (the agent also releases when the connection drops). ``force``:
        also when not held (withdraws a prepare). Never raises, except :class:`RankLost`."""
        if not self.held and not force:
            return None
        t0 = time.perf_counter()
        if self.held and not force:
            decision = self.planner.decide(self._backlog())
            if not decision.release:  # the trainer keeps its GPUs: the valley cannot pay for a round trip
                log.info("[timeslice] job=%s SKIP release at=%s: %s", self.job, point, decision.reason)
                out = HandoffFigures("skip", point, detail=decision.reason, seconds=time.perf_counter() - t0)
                self.report(out)
                return out
        out = HandoffFigures("release", point)
        if self.held:
            if self.swap != "checkpoint":
                park = self._park()
                if park is None:
                    return None  # the ranks could not park: they keep the GPUs until the next release
                out.park, out.swap = park, self.swap
            else:
                out.memory = self._release_caches()
        return self._give(out, t0, done=False)

    def _give(self, out: HandoffFigures, t0: float, *, done: bool) -> HandoffFigures:
        """The agent's part of a release, agreed by every rank, then reported."""
        self.held = False
        error: BaseException | None = None
        if self.client is not None:
            t1 = time.perf_counter()
            try:
                if out.park and not done:
                    out.agent = self.client.release(self.job, swap=self.swap, parked=_park_entries(out.park))
                else:
                    out.agent = self.client.release(self.job, done=done)
            except AgentError as exc:
                error = exc
            out.agent_s = time.perf_counter() - t1
        if done:  # nothing is frozen after a release with done: the ranks can still talk
            try:
                self._agree("release", error)
            except AgentError:
                pass
        # After a plain release the agent may freeze any rank at any moment, so the ranks say nothing more to
        # each other (a stopped peer would never answer); a release the agent refused leaves this node's GPUs
        # with the job for the valley, and the next acquire finds them held.
        if error is not None:
            out.ok, out.detail = False, str(error)
            log.error("[timeslice] job=%s %s at=%s failed (ignored): %s", self.job, out.action.upper(), out.point, error)
        out.seconds = time.perf_counter() - t0
        if out.action == "release":
            self._last_release_s = out.seconds
        if out.ok:
            log.info("[timeslice] job=%s %s at=%s took=%.1fms", self.job,
                     "CRASH-RELEASE" if out.action == "crash_release" else "RELEASE", out.point, out.seconds * 1e3)
        self.report(out)
        if out.ok and not done and out.action == "release":
            self._schedule_prepare()
        return out

    def _park(self) -> list[dict[str, Any]] | None:
        """Every rank's park report; None (and no rank left parked, if it can help it) when one failed."""
        assert self.ranks is not None
        try:
            reports = self.ranks.park()
        except RankLost:
            raise
        except Exception as exc:  # some ranks may have parked: bring them back, keep the GPU this valley
            log.error("[timeslice] job=%s park failed, keeping the GPU for this valley: %s", self.job, exc)
            try:
                self.ranks.unpark()
            except RankLost:
                raise
            except Exception as again:  # the next acquire tries again before the step touches the GPU
                self.parked = True
                log.error("[timeslice] job=%s unpark after a failed park failed too: %s", self.job, again)
            return None
        self.parked = True
        log.info("[timeslice] job=%s PARK %.2f GiB on %d rank(s) in %.0fms (slowest), kept %.2f GiB", self.job,
                 sum(int(r.get("parked", 0)) for r in reports) / 2**30, len(reports),
                 max((float(r.get("seconds", 0)) for r in reports), default=0) * 1e3,
                 sum(int(r.get("kept", 0)) for r in reports) / 2**30)
        return reports

    def _release_caches(self) -> dict[str, int]:
        """Every rank frees its GPU caches before a freeze; byte totals. A rank that cannot is frozen with them."""
        if self.ranks is None:
            return {}
        t0 = time.perf_counter()
        try:
            totals = summarize(self.ranks.release_caches())
        except RankLost:
            raise
        except Exception as exc:
            log.warning("[timeslice] job=%s ranks could not free their caches: %s", self.job, exc)
            return {}
        if totals["reserved_before"]:
            log.info("[timeslice] job=%s ranks freed caches in %.0fms: reserved %.2f -> %.2f GiB, live tensors %.2f GiB, "
                     "cupy %.2f GiB", self.job, (time.perf_counter() - t0) * 1e3, totals["reserved_before"] / 2**30,
                     totals["reserved_after"] / 2**30, totals["live"] / 2**30, totals["cupy_freed"] / 2**30)
        return totals

    # ------------------------------------------------------------------ the end: crash and done

    def crash(self, point: str) -> HandoffFigures:
        """An error escaped the trainer: get the tensors back where they belong, then release. Never raises."""
        return self._final(point, "crash_release", done=False)

    def done(self, point: str) -> HandoffFigures:
        """The run is over: every rank comes back from a park; the agent forgets the job (nothing is frozen)."""
        return self._final(point, "release", done=True)

    def _final(self, point: str, action: str, *, done: bool) -> HandoffFigures:
        self.cancel_prepare()
        self._prepared_at = None
        t0 = time.perf_counter()
        if self.parked:
            self._unpark_for_good(point)
        return self._give(HandoffFigures(action, point), t0, done=done)

    def _unpark_for_good(self, point: str) -> None:
        """Never leave ranks parked when the run stops or fails: take the GPU back, then unpark."""
        try:
            self.held = False
            self.acquire(point, timeout_s=FINAL_ACQUIRE_TIMEOUT_S)
            log.info("[timeslice] job=%s workers unparked at %s", self.job, point)
        except RankLost:
            raise
        except Exception as exc:  # no grant: the processes may still be locked, so no CUDA call now
            log.error("[timeslice] job=%s could not unpark the workers at %s: %s", self.job, point, exc)

    # ------------------------------------------------------------------ prepare

    def prepare(self, point: str = "trainer") -> HandoffFigures | None:
        """Ask the agent to start bringing the GPUs back (a hint: never raises, nothing to agree on)."""
        if self.held or self.client is None:
            return None
        t0 = time.perf_counter()
        out = HandoffFigures("prepare", point)
        try:
            out.agent = self.client.prepare(self.job)
        except AgentError as exc:
            log.warning("[timeslice] job=%s PREPARE failed: %s", self.job, exc)
            return None
        out.seconds = out.agent_s = time.perf_counter() - t0
        log.info("[timeslice] job=%s PREPARE at=%s (thaw started early) lead=%.0fms", self.job, point,
                 (self.planner.lead() or 0) * 1e3)
        self.report(out)
        return out

    def _schedule_prepare(self) -> None:
        if self.prepare_enabled and self.client is not None:
            self._way_back.start()

    def _bring_back(self, point: str) -> None:
        """The way back ahead of need (a :class:`WayBack` thread): with parked ranks the whole acquire and
        unpark, so the trainer's acquire waits for nothing; otherwise the agent's prepare."""
        if not self.parked:
            self.prepare(point)
            return
        self._acquire_now(point, time.perf_counter(), timeout_s=None)
        self._prepared_at = time.monotonic()

    def _backlog(self) -> tuple[int, int] | None:
        if self.backlog_source is None:
            return None
        try:
            return self.backlog_source()
        except Exception as exc:  # a signal, never a reason to fail a handoff
            log.debug("[timeslice] job=%s backlog unreadable: %s", self.job, exc)
            return None

    def cancel_prepare(self) -> None:
        """Stop a way back that has not started; wait for one under way."""
        self._way_back.stop()

    def close(self) -> None:
        self.cancel_prepare()
        if self.client is not None:
            self.client.close()
            self.client = None


__all__ = ["Handoff", "HandoffFigures", "PreparePlanner", "RankLost", "Ranks", "handoff_event", "summarize"]
