"""Validation runs in the background: the trainer says a version synced, and goes on.

At a due version (:mod:`~timeslice_verl.validate.schedule`) the :class:`Validator` takes a snapshot of its weights
from the trainer's :class:`WeightSource` (on the trainer's thread: the next step changes them), then on its own
thread pushes them into the policy tenant, submits the validation set as a batch (``tenant_role=policy``, above
users' priority, its version in the metadata), waits for it, scores every answer with verl's reward function and
hands verl's validation metrics — with ``timeslice/validate/version`` and the run's seconds — to ``log_metrics`` at
the version's step. A version due while a run is under way is held (its snapshot kept) until that run ends; what
could not keep up is reported (``late``), never dropped in silence. Nothing here ever blocks the trainer but the
snapshot.
"""

from __future__ import annotations

import json
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from timeslice_verl.batch.client import BatchClient
from timeslice_verl.batch.status import ENDED
from timeslice_verl.log import get_logger
from timeslice_verl.names import VALIDATION_VERSION, TenantRole
from timeslice_verl.validate.policy import PolicyBusy, PolicyTenant, Update
from timeslice_verl.validate.schedule import Move, Schedule
from timeslice_verl.validate.valset import Prompt, Sampling, Scorer, batch_lines, metrics, scored

log = get_logger("validate")


class Snapshot(Protocol):
    """One version's weights, kept until pushed."""

    def updates(self) -> Iterable[Update]: ...

    def release(self) -> None: ...


class WeightSource(Protocol):
    """Where the trainer's weights come from (its ranks on a GPU; a test's tensors)."""

    def snapshot(self, version: int) -> Snapshot: ...


@dataclass
class Run:
    """One validation run, as it went."""

    version: int
    batch_id: str = ""
    push_s: float = 0.0
    seconds: float = 0.0
    status: str = ""
    answers: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


class Validator:
    def __init__(self, *, every: int, policy: PolicyTenant, batch: BatchClient, source: WeightSource,
                 prompts: list[Prompt], sampling: Sampling, score: Scorer, model: str,
                 log_metrics: Callable[[dict[str, Any], int], None], priority: int = 100, poll_s: float = 2.0,
                 on_run: Callable[[Run], None] | None = None) -> None:
        self.schedule = Schedule(every)
        self.policy, self.batch, self.source = policy, batch, source
        self.prompts, self.sampling, self.score, self.model = prompts, sampling, score, model
        self.log_metrics, self.priority, self.poll_s = log_metrics, priority, poll_s
        self.on_run = on_run
        """Told of every run that ended (the adapters fire the ``validation_end`` hook with it)."""
        self.runs: list[Run] = []
        self._lock = threading.Lock()
        self._held: Snapshot | None = None
        self._work: queue.Queue[tuple[int, Snapshot] | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="timeslice-validate", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's side

    def synced(self, version: int, force: bool = False) -> Move:
        """The trainer's weights are now ``version`` (called on its thread: only the snapshot happens here);
        ``force``: validate it though it is not due (verl's ``val_before_train``, version 0)."""
        with self._lock:
            late_before = len(self.schedule.late)
            move = self.schedule.synced(version, force)
            if move is Move.none:
                return move
            snap = self.source.snapshot(version)
            if move is Move.push:
                self._work.put((version, snap))
            else:
                if self._held is not None:
                    self._held.release()
                self._held = snap
            for late in self.schedule.late[late_before:]:
                log.warning("[timeslice] validation: %s", late)
        return move

    def close(self, wait_s: float = 0.0) -> list[Run]:
        """Stop once the runs under way and held are done (waiting up to ``wait_s`` for them; 0: not at all); what
        ran. Runs still under way after that are stopped and reported."""
        self._work.put(None)
        if wait_s > 0:
            self._thread.join(wait_s)
        self._stop.set()
        with self._lock:
            if self._held is not None:
                self._held.release()
                self._held = None
        return list(self.runs)

    # ------------------------------------------------------------------ its own thread

    def _loop(self) -> None:
        following: tuple[int, Snapshot] | None = None
        while not self._stop.is_set():
            item = following or self._work.get()  # the held version goes before anything queued after it
            if item is None:
                return
            version, snap = item
            run = self._run(version, snap)
            if self.on_run is not None:
                try:
                    self.on_run(run)
                except Exception as exc:  # an observer's failure is logged by the hooks; never this thread's end
                    log.error("[timeslice] validation: reporting version %d's run failed: %s", version, exc)
            with self._lock:
                self.runs.append(run)
                after = self.schedule.finished(version)
                following = (after, self._held) if after is not None and self._held is not None else None
                if following is not None:
                    self._held = None

    def _run(self, version: int, snap: Snapshot) -> Run:
        run, t0 = Run(version), time.monotonic()
        try:
            try:
                run.push_s = self._push(version, snap)
            finally:
                snap.release()
            run.batch_id = self._submit(version)
            batch = self._wait(run.batch_id)
            run.status = batch["status"]
            answers = self._answers(batch)
            run.answers = len(answers)
            run.metrics = metrics(scored(self.prompts, version, answers, self.score))
            run.seconds = time.monotonic() - t0
            self.log_metrics({**run.metrics, "timeslice/validate/version": version,
                              "timeslice/validate/late": len(self.schedule.late),
                              "timeslice/validate/seconds": round(run.seconds, 3),
                              "timeslice/validate/push_s": round(run.push_s, 3)}, version)
            log.info("[timeslice] validation of version %d: %d answers in %.1f s (push %.2f s)", version,
                     run.answers, run.seconds, run.push_s)
        except Exception as exc:  # a validation that failed is reported, never the trainer's failure
            run.error, run.seconds = f"{type(exc).__name__}: {exc}", time.monotonic() - t0
            log.error("[timeslice] validation of version %d failed: %s", version, run.error)
        return run

    def _push(self, version: int, snap: Snapshot) -> float:
        """Push ``version`` once the tenant can take it: asleep (the trainer holds the GPU) or serving requests, it
        waits, its snapshot kept, until the tenant's valley; said once in the log."""
        said = False
        while True:
            try:
                return self.policy.push(version, snap.updates()).seconds
            except PolicyBusy as exc:
                if not said:
                    log.info("[timeslice] validation: %s", exc)
                    said = True
                if self._stop.wait(self.poll_s):
                    raise RuntimeError(f"stopped while version {version} waited for the policy tenant: {exc}") from exc

    def _submit(self, version: int) -> str:
        with tempfile.TemporaryDirectory(prefix="timeslice-val-") as tmp:
            path = Path(tmp) / f"val-{version}.jsonl"
            path.write_text("".join(batch_lines(self.prompts, version, self.model, self.sampling)))
            fid = self.batch.upload(path)["id"]
        made = self.batch.create(fid, "/v1/chat/completions", {VALIDATION_VERSION: str(version)},
                                 priority=self.priority, role=TenantRole.policy)
        return str(made["id"])

    def _wait(self, batch_id: str) -> dict[str, Any]:
        while (batch := self.batch.get(batch_id))["status"] not in ENDED:
            if self._stop.wait(self.poll_s):
                raise RuntimeError(f"stopped while batch {batch_id} ran")
        return batch

    def _answers(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        with tempfile.TemporaryDirectory(prefix="timeslice-val-") as tmp:
            for key in ("output_file_id", "error_file_id"):
                if batch.get(key):
                    path = Path(tmp) / key
                    self.batch.download(batch[key], path)
                    out += [json.loads(x) for x in path.read_text().split("\n") if x]
        return out


__all__ = ["Run", "Snapshot", "Validator", "WeightSource"]
