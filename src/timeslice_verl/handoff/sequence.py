"""The trainer side of a GPU handoff, written once: :class:`Handoff`.

Every trainer that lends its GPUs — verl's driver through the agent plugin, an SPMD trainer through
:class:`~timeslice_verl.handoff.spmd.RankHandoff` — runs the same sequence, built from the same settings
(:meth:`Handoff.from_settings`):

* **release**: every rank parks its tensors (``park``, ``park+checkpoint``) or frees its caches (``checkpoint``,
  ``resident``: the tensors stay on the GPU beside the tenant), then the agent's client releases the job; a rank
  that cannot park makes every rank unpark, and the job keeps its GPUs for that valley;
* **skip**: a release that cannot pay is not made (:mod:`~timeslice_verl.handoff.forecast`);
* **the way back** (:mod:`~timeslice_verl.handoff.wayback`), ahead of need, in the background;
* **acquire**: the agent grants the GPUs (it yielded the tenant, unlocked and restored the processes), then every
  rank unparks — unless the way back already did;
* **crash** / **done**: the GPUs come back and every rank unparks before the final release, so no rank is ever
  left without its tensors; the agent forgets a job released with ``done``.

One owner: the trainer's thread alone writes the handoff's state (``held``, ``granted``, ``parked``, the forecast).
The way back reads a frozen plan and hands what it did back as an :class:`~timeslice_verl.handoff.wayback.Outcome`,
which the trainer's next call takes in (within that call's bound) before anything else.

What differs between trainers lives behind :class:`Ranks` and the client (one node's agent, or every node's:
:mod:`~timeslice_verl.handoff.nodes`). Each handoff is reported as :class:`HandoffFigures` to a callback.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.handoff import start
from timeslice_verl.handoff.backlog import Backlog
from timeslice_verl.handoff.figures import HandoffFigures, handoff_event, park_entries, resident_entries, summarize
from timeslice_verl.handoff.forecast import ValleyForecast
from timeslice_verl.handoff.options import HandoffOptions
from timeslice_verl.handoff.ranks import RankLost, Ranks
from timeslice_verl.handoff.wayback import Outcome, WayBack
from timeslice_verl.hooks.events import PREPARE_POINT
from timeslice_verl.log import get_logger
from timeslice_verl.names import SwapMode

log = get_logger("handoff")

FINAL_ACQUIRE_TIMEOUT_S = 120.0
"""The longest a crash or the end of the run waits to get the GPUs back (a way back under way included) before it
releases without unparking."""


class Handoff:
    """One job's handoffs on this node: the agent connection (``client``: None on ranks that only follow), the
    ranks, the options, the valley forecast and the way back. ``report`` receives every handoff's figures.
    ``held`` starts True: a trainer starts on its GPU."""

    def __init__(self, job: str, *, client: AgentClient | Any | None, ranks: Ranks | None,
                 options: HandoffOptions = HandoffOptions(), report: Callable[[HandoffFigures], None] | None = None,
                 backlog: Callable[[], Any] | None = None) -> None:
        self.options = options.check(can_park=ranks is not None)
        self.job, self.client, self.ranks, self.swap = job, client, ranks, self.options.swap
        self.forecast = ValleyForecast(lead_s=self.options.prepare_lead_s, margin=self.options.break_even_margin,
                                       late_cost=self.options.late_cost)
        self.report = report or (lambda figures: None)
        self.held = True
        """The job holds its GPUs and every rank has its tensors."""
        self.granted = True
        """The agent's part: the job holds its GPUs (its ranks may still be parked)."""
        self.parked = False
        """The ranks' tensors are in pinned host RAM."""
        self._backlog = Backlog(backlog, job=job)
        self._way_back = WayBack(Backlog(backlog, job=job), self._bring_back)
        self._valley_start: float | None = None
        self._reads: list[tuple[float, tuple[int, int] | None]] = []
        """The backlog as read through the valley under way (the release's read, then the way back's)."""
        self._last_release_s = 0.0

    @classmethod
    def from_settings(cls, settings: Any, *, client: Any, ranks: Ranks | None, report: Any = None, backlog: Any = None,
                      **override: Any) -> Handoff:
        """The one way to build a handoff from a ``timeslice`` section: every ``handoff`` key reaches it."""
        return cls(settings.job, client=client, ranks=ranks, options=HandoffOptions.from_settings(settings, **override),
                   report=report, backlog=backlog)

    # ------------------------------------------------------------------ set-up

    def begin(self) -> list[dict[str, Any]]:
        """After the model is loaded: choose the swap (``auto``), pin the host buffers for parking (slow: never in a
        handoff), estimate the round trip for the first valleys and register the ranks' pids. The pin reports."""
        return start.begin(self)

    # ------------------------------------------------------------------ acquire

    def acquire(self, point: str, *, timeout_s: float | None = None) -> HandoffFigures | None:
        """Block until the job owns its GPUs and every rank has its tensors; None when it already did. An agent
        that refuses raises (the trainer never trains without its GPU). The whole wait, a way back under way
        included, is bounded by ``timeout_s`` (default: the options' ``acquire_timeout_s``)."""
        t0 = time.monotonic()
        bound = timeout_s if timeout_s is not None else self.options.acquire_timeout_s
        back = self._take_way_back(bound)
        self._end_valley(t0)
        if self.held:
            if back is None or not back.unparked or back.done is None:
                return None
            out = HandoffFigures("acquire", point, seconds=time.monotonic() - t0, detail="prepared ahead of need",
                                 early_s=max(0.0, t0 - back.done))
            self.report(out)
            return out
        left = None if bound is None else bound - (time.monotonic() - t0)
        if left is not None and left <= 0:
            raise AgentError("timeout", f"job {self.job!r} did not get its GPUs back within {bound:g} s")
        return self._acquire_now(point, t0, timeout_s=left)

    def _acquire_now(self, point: str, t0: float, *, timeout_s: float | None = None) -> HandoffFigures:
        out = HandoffFigures("acquire", point)
        error: BaseException | None = None
        if self.client is not None and not self.granted:  # the way back may have done the agent's part
            try:
                out.agent = self.client.acquire(self.job, timeout_s=timeout_s)
            except AgentError as exc:
                error = exc
            out.agent_s = time.monotonic() - t0
        self._agree("acquire", error)
        self.granted = True
        if self.parked:  # after the agent unlocked (and restored) the ranks
            out.park, out.swap = self._unpark(), self.swap
        self.held = True
        out.seconds = time.monotonic() - t0
        self._learn(out)
        log.info("[timeslice] job=%s ACQUIRE at=%s waited=%.0fms thawed=%s thaw=%.0fms frozen=%.2fGiB", self.job,
                 point, out.seconds * 1e3, bool(out.agent.get("thawed")), float(out.agent.get("thaw_s", 0)) * 1e3,
                 out.agent.get("frozen_bytes", 0) / 2**30)
        self.report(out)
        return out

    def _learn(self, out: HandoffFigures) -> None:
        """What an acquire's reply tells of the way back and the round trip (the agent's moves since the release)."""
        if not out.agent.get("transitions"):
            return
        moves = {a: sum(t["end"] - t["start"] for t in out.agent["transitions"] if t["action"] == a)
                 for a in ("freeze", "thaw", "tenant_yield", "tenant_reclaim")}
        self.forecast.observe_way_back(moves["thaw"] + moves["tenant_yield"] + out.park_s)
        self.forecast.observe_round_trip(self._last_release_s + sum(moves.values()) + out.park_s)

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

    def _shared(self, value: Any) -> Any:
        shared = getattr(self.ranks, "shared", None)
        return shared(value) if shared is not None else value

    # ------------------------------------------------------------------ the way back and the valley's end

    def _take_way_back(self, bound: float | None) -> Outcome | None:
        """Take in what the way back did (waiting up to ``bound`` for one under way); raise what cannot be recovered."""
        back = self._way_back.take(bound)
        if back is None:
            return None
        for t, backlog in back.reads:
            self.forecast.observe_backlog(t, backlog)
        self._reads += back.reads
        if back.running:
            raise AgentError("timeout", f"job {self.job!r}: the way back ahead of need did not get the GPUs back within "
                                        f"{bound:g} s")
        if isinstance(back.error, RankLost):
            raise back.error
        self.granted = self.granted or back.granted
        self.parked = self.parked and not back.unparked
        # SPMD ranks still agree that every node's agent granted: the acquire does that, without asking again
        self.held = self.granted and not self.parked and not getattr(self.ranks, "collective", False)
        if back.figures is not None:
            self._learn(back.figures)
            self.report(back.figures)
        return back

    def _bring_back(self) -> tuple[HandoffFigures, bool, bool]:
        """The way back's work (its own thread): the agent's acquire, and every rank's unpark where one process
        drives them all. Reads the handoff's state, writes none of it."""
        assert self.client is not None
        t0 = time.monotonic()
        out = HandoffFigures("acquire", PREPARE_POINT)
        out.agent = self.client.acquire(self.job, timeout_s=self.options.acquire_timeout_s)
        unparked = not self.parked
        if self.parked and not getattr(self.ranks, "collective", False):
            try:
                out.park, out.swap = self.ranks.unpark(), self.swap  # type: ignore[union-attr]
                unparked = True
            except RankLost:
                raise
            except Exception as exc:  # the trainer's acquire unparks again
                out.detail = f"unpark failed: {exc}"
                log.warning("[timeslice] job=%s the way back could not unpark (the acquire tries again): %s", self.job, exc)
        out.seconds = out.agent_s = time.monotonic() - t0
        out.at = time.time()
        return out, True, unparked

    def _end_valley(self, now: float) -> None:
        """The trainer asks for its GPUs: the valley that began at the last release (or skip) is over."""
        start, self._valley_start = self._valley_start, None
        self.forecast.observe_backlog(now, self._backlog.read())
        if start is not None:
            self.forecast.observe_valley(now - start, self._reads, end=now)
        self._reads = []

    # ------------------------------------------------------------------ release

    def release(self, point: str) -> HandoffFigures | None:
        """Park (or free caches), then give the GPUs to the agent; a valley that cannot pay is skipped. A failed park
        keeps them this valley; a failed agent call is logged (the agent also releases when the connection drops).
        Never raises, except :class:`RankLost`."""
        if not self.held:
            return None
        t0 = time.monotonic()
        backlog = self._backlog.read()
        self.forecast.observe_backlog(t0, backlog)
        decision = self._shared(self.forecast.decide(backlog))
        self._valley_start, self._reads = t0, [(t0, backlog)]
        if not decision.release:  # the trainer keeps its GPUs: the valley cannot pay for a round trip
            log.info("[timeslice] job=%s SKIP release at=%s: %s", self.job, point, decision.reason)
            out = HandoffFigures("skip", point, detail=decision.reason, seconds=time.monotonic() - t0)
            self.report(out)
            return out
        out = HandoffFigures("release", point, detail=decision.reason)
        if self.swap is not None and self.swap.parks:
            park = self._park()
            if park is None:
                return None  # the ranks could not park: they keep the GPUs until the next release
            out.park, out.swap = park, self.swap
        else:
            out.memory, out.park = self._release_caches()
            out.swap = self.swap
        return self._give(out, t0, done=False)

    def _give(self, out: HandoffFigures, t0: float, *, done: bool) -> HandoffFigures:
        """The agent's part of a release, agreed by every rank, then reported."""
        self.held = self.granted = False
        error: BaseException | None = None
        if self.client is not None:
            t1 = time.monotonic()
            try:
                out.agent = self._release_call(out, done)
            except AgentError as exc:
                error = exc
            out.agent_s = time.monotonic() - t1
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
        out.seconds = time.monotonic() - t0
        if out.action == "release":
            self._last_release_s = out.seconds
        if out.ok:
            log.info("[timeslice] job=%s %s at=%s took=%.1fms", self.job,
                     "CRASH-RELEASE" if out.action == "crash_release" else "RELEASE", out.point, out.seconds * 1e3)
        self.report(out)
        if out.ok and not done and out.action == "release" and self.options.prepare and self.client is not None:
            self._way_back.start(self.forecast.plan(), self.forecast.arrivals.copy(), released=t0)
        return out

    def _release_call(self, out: HandoffFigures, done: bool) -> dict[str, Any]:
        assert self.client is not None
        if done or not out.park:
            return self.client.release(self.job, done=done)
        if self.swap is SwapMode.resident:
            return self.client.release(self.job, swap=SwapMode.resident, parked=resident_entries(out.park))
        return self.client.release(self.job, swap=self.swap, parked=park_entries(out.park))

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
                self.parked, self.held = True, False
                log.error("[timeslice] job=%s unpark after a failed park failed too: %s", self.job, again)
            return None
        self.parked = True
        log.info("[timeslice] job=%s PARK %.2f GiB on %d rank(s) in %.0fms (slowest), kept %.2f GiB", self.job,
                 sum(int(r.get("parked", 0)) for r in reports) / 2**30, len(reports),
                 max((float(r.get("seconds", 0)) for r in reports), default=0) * 1e3,
                 sum(int(r.get("kept", 0)) for r in reports) / 2**30)
        return reports

    def _release_caches(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """Every rank frees its GPU caches before the release; byte totals and the ranks' reports."""
        if self.ranks is None:
            return {}, []
        t0 = time.perf_counter()
        try:
            reports = self.ranks.release_caches()
        except RankLost:
            raise
        except Exception as exc:
            log.warning("[timeslice] job=%s ranks could not free their caches: %s", self.job, exc)
            return {}, []
        totals = summarize(reports)
        if totals["reserved_before"]:
            sync = max((float(r.get("sync_s", 0.0)) for r in reports), default=0.0)
            log.info("[timeslice] job=%s ranks freed caches in %.0fms (%.0fms of it their last kernels): reserved %.2f -> "
                     "%.2f GiB, live tensors %.2f GiB, cupy %.2f GiB", self.job, (time.perf_counter() - t0) * 1e3,
                     sync * 1e3, totals["reserved_before"] / 2**30,
                     totals["reserved_after"] / 2**30, totals["live"] / 2**30, totals["cupy_freed"] / 2**30)
        return totals, reports if self.swap is SwapMode.resident else []

    # ------------------------------------------------------------------ the end: crash and done

    def crash(self, point: str) -> HandoffFigures:
        """An error escaped the trainer: get the tensors back where they belong, then release. Never raises."""
        return self._final(point, "crash_release", done=False)

    def done(self, point: str) -> HandoffFigures:
        """The run is over: every rank comes back from a park; the agent forgets the job (nothing is frozen)."""
        return self._final(point, "release", done=True)

    def _final(self, point: str, action: str, *, done: bool) -> HandoffFigures:
        t0 = time.monotonic()
        try:
            self._take_way_back(FINAL_ACQUIRE_TIMEOUT_S)
        except RankLost:
            raise
        except AgentError as exc:  # still under way: the release below ends its acquire; the ranks stay as they are
            log.error("[timeslice] job=%s at %s: %s; releasing without waiting for it", self.job, point, exc)
        else:
            if self.parked:
                self._unpark_for_good(point, FINAL_ACQUIRE_TIMEOUT_S - (time.monotonic() - t0))
        self._valley_start = None
        return self._give(HandoffFigures(action, point), t0, done=done)

    def _unpark_for_good(self, point: str, bound: float) -> None:
        """Never leave ranks parked when the run stops or fails: take the GPU back, then unpark."""
        try:
            self.held = False
            self.acquire(point, timeout_s=max(1.0, bound))
            log.info("[timeslice] job=%s workers unparked at %s", self.job, point)
        except RankLost:
            raise
        except Exception as exc:  # no grant: the processes may still be locked, so no CUDA call now
            log.error("[timeslice] job=%s could not unpark the workers at %s: %s", self.job, point, exc)

    # ------------------------------------------------------------------ prepare (a hint by hand) and close

    def prepare(self, point: str = "trainer") -> HandoffFigures | None:
        """Ask the agent to start bringing the GPUs back (a hint: never raises, nothing to agree on)."""
        if self.held or self.client is None:
            return None
        t0 = time.monotonic()
        out = HandoffFigures("prepare", point)
        try:
            out.agent = self.client.prepare(self.job)
        except AgentError as exc:
            log.warning("[timeslice] job=%s PREPARE failed: %s", self.job, exc)
            return None
        out.seconds = out.agent_s = time.monotonic() - t0
        log.info("[timeslice] job=%s PREPARE at=%s (thaw started early)", self.job, point)
        self.report(out)
        return out

    def close(self) -> None:
        self._way_back.take(0)
        if self.client is not None:
            self.client.close()
            self.client = None


__all__ = ["FINAL_ACQUIRE_TIMEOUT_S", "Handoff", "HandoffFigures", "HandoffOptions", "handoff_event"]
