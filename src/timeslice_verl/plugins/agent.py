"""The agent plugin: turns lifecycle events into GPU handoffs through the node's snapshot agent.

=========================  ==================================================================
event                      handoff
=========================  ==================================================================
init_workers_begin         acquire (model loading needs the GPU)
init_workers_end           release (the trainer waits for samples next)
post_rollout               learn the queue rhythm; a timer sends ``prepare`` early next time
pre_train_step             acquire — blocks until the trainer's processes are restored
weight_sync_begin          make sure the GPU is held (a real acquire only before the pre-fit sync)
weight_sync_end            release, when weights were synced and no model save follows in this step
save_checkpoint_begin      make sure the GPU is held, and allow the save
save_checkpoint_end        release (after the step's save: the release deferred at weight_sync_end)
trainer_exception          crash-release (never leave the GPU pinned to a dead job)
timeslice_stop             release, close the connection
=========================  ==================================================================

An acquire that fails raises (gating hooks stop the trainer: it never trains without its GPU); a
release that fails is logged and swallowed (the agent also releases when the connection drops).
One log line per handoff: ``[timeslice] job=… ACQUIRE waited=…ms restored=…`` / ``RELEASE …``.
Each handoff is reported through the ``handoff`` hook for the timeline and metrics plugins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.config import TimesliceSettings, socket_path
from timeslice_verl.events import Event, HandoffEvent, RolloutEvent, Transition
from timeslice_verl.hookspecs import hookimpl
from timeslice_verl.log import get_logger
from timeslice_verl.names import split_urls
from timeslice_verl.plugins.prepare import PreparePlanner

log = get_logger("handoff")


def summarize(reports: list[dict[str, Any]]) -> dict[str, int]:
    """Byte totals over ranks: ``live``, ``reserved_before``, ``reserved_after``, ``cupy_freed``."""
    total = {"live": 0, "reserved_before": 0, "reserved_after": 0, "cupy_freed": 0}
    for r in reports:
        total["live"] += int(r.get("live_after", 0))
        total["reserved_before"] += int(r.get("reserved_before", 0))
        total["reserved_after"] += int(r.get("reserved_after", 0))
        total["cupy_freed"] += int(r.get("cupy_before", 0)) - int(r.get("cupy_after", 0))
    return total


class AgentPlugin:
    name = "agent"

    def __init__(self) -> None:
        self.client: AgentClient | None = None
        self.settings: TimesliceSettings | None = None
        self.lifecycle: Any = None
        self.job = ""
        self.held = False
        self.held_for_save = False
        self.release_after_save = False
        self.planner = PreparePlanner()
        self.swap = "checkpoint"
        self.parked = False
        """The workers' tensors are in pinned host RAM (released with a park swap, not yet unparked)."""
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up

    @hookimpl
    def timeslice_start(self, trainer: Any, event: Event, lifecycle: Any) -> None:
        self.settings = lifecycle.settings
        self.lifecycle = lifecycle
        self.job = lifecycle.job
        self.planner = PreparePlanner(lead_s=self.settings.handoff.prepare_lead_s)
        self.swap = str(self.settings.handoff.swap)
        workers = getattr(lifecycle, "workers", None)
        if self.swap != "checkpoint" and workers is None:
            raise ValueError(f"timeslice.handoff.swap={self.swap} needs trainer workers that can park their tensors "
                             "(verl's worker groups, or a RankHandoff in an SPMD trainer); this trainer has none: "
                             "use timeslice.handoff.swap=checkpoint")
        path = socket_path(self.settings)
        self.client = AgentClient(path, connect_timeout_s=self.settings.agent.connect_timeout_s, client=f"trainer:{self.job}")
        try:
            hello = self.client.hello()
        except AgentError as exc:
            if not self.settings.agent.autostart:
                raise AgentError(exc.code, f"{exc.message} (or set timeslice.agent.autostart=true)") from None
            hello = self._autostart()
        log.info(
            "[timeslice] job=%s agent pid %s on %s, backend %s%s",
            self.job, hello.get("pid"), path, hello.get("backend"),
            "" if hello.get("frees_gpu_memory") else " (CPU TEST BACKEND: GPU memory is not freed)",
        )
        self._ensure_tenant()

    def _autostart(self) -> dict[str, Any]:
        s = self.settings
        assert s is not None and self.client is not None
        args = [
            sys.executable, "-m", "timeslice_verl.cli", "agent",
            f"timeslice.agent.socket={socket_path(s)}",
            f"timeslice.agent.backend={s.agent.backend}",
            f"timeslice.agent.gpus=[{','.join(map(str, s.agent.gpus))}]",
            "timeslice.tenant.urls=[" + ",".join(f'"{u}"' for u in split_urls(s.tenant.url)) + "]",
        ]
        log_path = socket_path(s).with_name("agent.log")
        socket_path(s).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # O_NOFOLLOW: never write through a link someone planted at the log's path
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "a") as out:
            subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        log.info("[timeslice] started an agent (log %s)", log_path)
        return self.client.hello()

    def _ensure_tenant(self) -> None:
        assert self.client is not None and self.settings is not None
        url = self.settings.tenant.url
        if not url:
            return
        status = self.client.status()
        if status.get("tenant") is None:
            try:
                self.client.register_tenant(url, sleep_level=self.settings.tenant.sleep_level)
            except AgentError as exc:
                log.error("[timeslice] job=%s could not register tenant %s: %s (training goes on)", self.job, url, exc)

    # ------------------------------------------------------------------ handoffs

    def _release_caches(self) -> dict[str, int]:
        """Have every worker rank free its GPU caches before the freeze; byte totals (empty outside verl)."""
        workers = getattr(self.lifecycle, "workers", None)
        if workers is None:
            return {}
        t0 = time.perf_counter()
        try:
            totals = summarize(workers.release_caches())
        except Exception as exc:  # a worker that cannot free its caches is frozen with them
            log.warning("[timeslice] job=%s workers could not free their caches: %s", self.job, exc)
            return {}
        if totals["reserved_before"]:
            log.info(
                "[timeslice] job=%s workers freed caches in %.0fms: reserved %.2f -> %.2f GiB, live tensors %.2f GiB, cupy %.2f GiB",
                self.job, (time.perf_counter() - t0) * 1e3, totals["reserved_before"] / 2**30, totals["reserved_after"] / 2**30,
                totals["live"] / 2**30, totals["cupy_freed"] / 2**30,
            )
        return totals

    def _park(self) -> list[dict[str, Any]] | None:
        """Every worker parks its tensors; None (nothing left parked) when any rank could not."""
        workers = self.lifecycle.workers
        try:
            reports = workers.park()
        except Exception as exc:  # some ranks may have parked: bring them back, keep the GPU this valley
            log.error("[timeslice] job=%s park failed, keeping the GPU for this valley: %s", self.job, exc)
            try:
                workers.unpark()
            except Exception as again:  # the next acquire tries again before the step touches the GPU
                self.parked = True
                log.error("[timeslice] job=%s unpark after a failed park failed too: %s", self.job, again)
            return None
        self.parked = True
        log.info("[timeslice] job=%s PARK %.2f GiB on %d rank(s) in %.0fms (slowest), kept %.2f GiB",
                 self.job, sum(r["parked"] for r in reports) / 2**30, len(reports),
                 max((r["seconds"] for r in reports), default=0) * 1e3, sum(r["kept"] for r in reports) / 2**30)
        return reports

    def _unpark(self) -> list[dict[str, Any]]:
        reports = self.lifecycle.workers.unpark()
        self.parked = False
        return reports

    def _unpark_for_good(self, point: str) -> None:
        """Never leave workers parked when the run stops or fails: take the GPU back, then unpark."""
        if not self.parked or self.client is None:
            return
        try:
            self.client.acquire(self.job, timeout_s=120)
            self.held = True
            self._unpark()
            log.info("[timeslice] job=%s workers unparked at %s", self.job, point)
        except Exception as exc:  # no grant: the processes may still be locked, so no CUDA call now
            log.error("[timeslice] job=%s could not unpark the workers at %s: %s", self.job, point, exc)

    def _report(
        self, action: str, point: str, waited: float, result: dict[str, Any], ok: bool = True, detail: str = "",
        memory: dict[str, int] | None = None, park: list[dict[str, Any]] | None = None,
    ) -> None:
        if self.lifecycle is None:
            return
        transitions = tuple(Transition.from_dict(t) for t in result.get("transitions", []))
        memory = memory or {}
        event = self.lifecycle.event(HandoffEvent, action=action, point=point, waited_s=round(waited, 6), ok=ok,
                                     detail=detail, transitions=transitions, live_bytes=memory.get("live", 0),
                                     reserved_before=memory.get("reserved_before", 0),
                                     reserved_after=memory.get("reserved_after", 0),
                                     swap=self.swap if park else "", parked_bytes=sum(r["parked"] for r in park or []),
                                     park_s=max((r["seconds"] for r in park or []), default=0.0))
        self.lifecycle.notify("handoff", event)

    def acquire(self, point: str) -> None:
        """Block until the trainer owns the GPU. Errors propagate."""
        assert self.client is not None and self.settings is not None
        self._cancel_timer()
        if self.held:
            if self.parked:  # a park that failed half-way left ranks parked: they need their tensors now
                self._unpark()
            return
        t0 = time.perf_counter()
        timeout = self.settings.handoff.acquire_timeout_s or None
        result = self.client.acquire(self.job, timeout_s=timeout)
        self.held = True
        unpark = self._unpark() if self.parked else None  # after the agent unlocked (and restored) the workers
        waited = time.perf_counter() - t0
        restore = float(result.get("restore_s", 0.0))
        yield_s = sum(t["end"] - t["start"] for t in result.get("transitions", []) if t["action"] == "tenant_yield")
        unpark_s = max((r["seconds"] for r in unpark or []), default=0.0)
        if result.get("restored"):
            self.planner.observe_restore(restore + yield_s + unpark_s)
        log.info(
            "[timeslice] job=%s ACQUIRE at=%s waited=%.0fms restored=%s restore=%.0fms frozen=%.2fGiB",
            self.job, point, waited * 1e3, bool(result.get("restored")), restore * 1e3, result.get("bytes", 0) / 2**30,
        )
        self._report("acquire", point, waited, result, park=unpark)

    def release(self, point: str, *, crash: bool = False, force: bool = False, done: bool = False) -> None:
        """Give the GPU back (``force``: also when not held, to cancel a prepare; ``done``: the run is over,
        nothing to freeze). Never raises."""
        if self.client is None or (not self.held and not crash and not force):
            return
        t0 = time.perf_counter()
        if crash or done:
            self._unpark_for_good(point)
        idle = not (crash or done or not self.held)
        park = self._park() if idle and self.swap != "checkpoint" else None
        if idle and self.swap != "checkpoint" and park is None:
            return  # the workers could not park: they keep the GPU until the next release
        memory = self._release_caches() if idle and park is None else {}
        self.held = False
        self.held_for_save = False
        self.release_after_save = False
        try:
            if park is not None:
                result = self.client.release(self.job, done=done, swap=self.swap, parked=park)
            else:
                result = self.client.release(self.job, done=done)
        except Exception as exc:  # the agent also releases when our connection drops
            log.error("[timeslice] job=%s RELEASE at=%s failed (ignored): %s", self.job, point, exc)
            self._report("crash_release" if crash else "release", point, time.perf_counter() - t0, {}, ok=False, detail=str(exc))
            return
        waited = time.perf_counter() - t0
        log.info("[timeslice] job=%s %s at=%s took=%.1fms", self.job, "CRASH-RELEASE" if crash else "RELEASE", point, waited * 1e3)
        self._report("crash_release" if crash else "release", point, waited, result, memory=memory, park=park)
        if not crash and not force:
            self._schedule_prepare()

    def _schedule_prepare(self) -> None:
        assert self.settings is not None
        if not self.settings.handoff.prepare:
            return
        delay = self.planner.delay()
        if delay is None:
            return
        with self._lock:
            self._cancel_timer_locked()
            self._timer = threading.Timer(delay, self._send_prepare)
            self._timer.daemon = True
            self._timer.start()

    def _send_prepare(self) -> None:
        if self.held or self.client is None:
            return
        t0 = time.perf_counter()
        try:
            result = self.client.prepare(self.job)
        except AgentError as exc:
            log.warning("[timeslice] job=%s PREPARE failed: %s", self.job, exc)
            return
        log.info("[timeslice] job=%s PREPARE (restore started early) lead=%.0fms", self.job, (self.planner.lead() or 0) * 1e3)
        self._report("prepare", "timer", time.perf_counter() - t0, result)

    def _cancel_timer(self) -> None:
        with self._lock:
            self._cancel_timer_locked()

    def _cancel_timer_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------------ hooks

    @hookimpl
    def init_workers_begin(self) -> None:
        self.acquire("init_workers_begin")

    @hookimpl
    def init_workers_end(self, trainer: Any) -> None:
        workers = getattr(self.lifecycle, "workers", None)
        if self.swap != "checkpoint" and workers is not None and not workers.can_park():
            log.error("[timeslice] job=%s handoff.swap=%s but the workers have no park method (is timeslice-verl installed "
                      "where the workers run?): swapping by checkpoint instead", self.job, self.swap)
            self.swap = "checkpoint"
        if self.swap != "checkpoint" and workers is not None:
            t0 = time.perf_counter()
            pinned = workers.park_reserve()  # pinning is slow: once, here, not in a handoff
            log.info("[timeslice] job=%s pinned %.2f GiB of host RAM for parking on %d rank(s) in %.1f s", self.job,
                     sum(r["pinned"] for r in pinned) / 2**30, len(pinned), time.perf_counter() - t0)
        pids = workers.local_pids() if workers is not None else []
        if pids and self.client is not None:
            try:
                self.client.register_pids(self.job, pids)
                log.info("[timeslice] job=%s registered worker pids %s", self.job, pids)
            except AgentError as exc:
                log.warning("[timeslice] job=%s could not register worker pids %s: %s (tag discovery still applies)", self.job, pids, exc)
        self.release("init_workers_end")

    @hookimpl
    def post_rollout(self, event: RolloutEvent) -> None:
        self.planner.observe_wait(event.queue_wait_s)

    @hookimpl
    def pre_train_step(self) -> None:
        self.acquire("pre_train_step")

    @hookimpl
    def weight_sync_begin(self) -> None:
        self.acquire("weight_sync_begin")  # no-op when already held

    @hookimpl
    def weight_sync_end(self, event: Any) -> None:
        if not event.synced:
            return
        if getattr(event, "save_follows", False):
            self.release_after_save = True  # the step's save still needs the GPU: release after it
            return
        self.release("weight_sync_end")

    @hookimpl
    def save_checkpoint_begin(self) -> bool:
        if not self.held:
            self.acquire("save_checkpoint_begin")
            self.held_for_save = True
        return True  # the save always runs: the trainer holds the GPU for it

    @hookimpl
    def save_checkpoint_end(self) -> None:
        if self.held_for_save or self.release_after_save:
            self.release("save_checkpoint_end")

    @hookimpl
    def trainer_exception(self, event: Any) -> None:
        self._cancel_timer()
        self.release(f"exception:{event.point}", crash=True)

    @hookimpl(tryfirst=True)  # its last release reaches the observers before they close
    def timeslice_stop(self) -> None:
        self._cancel_timer()
        # done: the workers are exiting, so the agent forgets the job rather than freezing them; force:
        # also withdraws a prepare sent for a step that never comes
        self.release("timeslice_stop", force=True, done=True)
        if self.client is not None:
            self.client.close()
            self.client = None


__all__ = ["AgentPlugin", "PreparePlanner"]
