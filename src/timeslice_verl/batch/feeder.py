"""The batch service's feeder: keeps the tenant full while it has the GPU, and decides each answer's fate.

* **Slots.** A line holds a slot from its send until its answer arrives; the answer's write happens behind it (one
  writer, many outcomes a transaction), and the next lines are claimed ahead, in the background (up to the
  limit), so the tenant never waits on the database.
* **How many.** The limit follows the tenant (:mod:`timeslice_verl.batch.concurrency`): sampled from vLLM's
  ``/metrics`` while the gate is open, from ``timeslice.batch.concurrency`` up to ``max_concurrency``. A limit that
  falls after a probe that cost tokens takes effect at once: the newest sends past it are cancelled (vLLM aborts a
  request whose client went away) and their lines go back to the queue, the try not counted — with long
  completions, waiting for them to end kept such a probe in place for a whole valley (512-token answers at 768 in
  flight: ~25 s each). A look below the best limit lets what is in flight drain instead, and its window opens
  once it has.
* **HTTP.** One aiohttp session, connections kept alive: its CPU per request does not grow with the number in
  flight (httpx's pool bookkeeping did; ``benchmarks/harvest_cpu.py`` measures both).
* **Retries.** A line whose request failed for a reason that is not the request's — the ladder's abort (an answer
  with ``finish_reason: abort``), a killed or restarting server (the connection refused, reset or cut), a time-out,
  a 5xx — is queued again after a backoff (0.5 s doubling, at most 30 s), at most ``max_attempts`` times; then it
  goes to the error file with the last reason. A 4xx is the request's own fault: failed at once, with vLLM's answer.
* **Resumes.** An aborted answer's output is kept with its line, in the transaction that queues it again, and the
  next try continues it (:mod:`timeslice_verl.batch.resume`; that try is not counted: each one keeps a token more).
  A 4xx on a continued request starts the line again without what was kept.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from timeslice_verl.backoff import Backoff
from timeslice_verl.batch import resume
from timeslice_verl.batch.answer import ABORTED, classify, parsed, refused
from timeslice_verl.batch.background import spawn
from timeslice_verl.batch.concurrency import Follower, Policy, Sample, parse_metrics, shed_to
from timeslice_verl.batch.gate import Gate
from timeslice_verl.batch.idle import Waker
from timeslice_verl.batch.pacing import Latency, Pacer
from timeslice_verl.batch.store import LEASE_S, Line, Outcome, Store, StoreUnavailable
from timeslice_verl.batch.usage import Valley
from timeslice_verl.log import get_logger
from timeslice_verl.names import TenantRole

log = get_logger("batch")

LINE_AGAIN = Backoff(0.5, 30.0)
"""A line whose try failed for a reason not its own waits this long before it is sent again."""
STORE_AGAIN = Backoff(0.5, 10.0)
"""While the database cannot be written."""
SAMPLE_S = 0.5
"""How often the tenant's ``/metrics`` are read while the gate is open (the generation rate is taken over it; a
valley's first interval, its ramp, is left out)."""
SETTLE_S = 5.0
"""How often open batches are checked for their window and cancels (also while the trainer holds the GPU)."""
WRITE_MAX, WRITE_GATHER, GATHER_S = 1024, 64, 0.02
"""A transaction's most answers; under WRITE_GATHER waiting, the writer waits GATHER_S for more (CPU per line)."""
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass
class FeederStats:
    """What the feeder did, for ``/timeslice/summary`` and ``/metrics``."""

    limit: int = 0
    inflight: int = 0
    sent: int = 0
    answered: int = 0
    written: int = 0
    writes: int = 0
    shed: int = 0
    """Sends cancelled because the limit fell below them (their lines queued again)."""
    resumed: int = 0  # tries that continued a line from the output an abort left
    kept: int = 0  # tokens aborted answers generated, kept with their lines (never generated again)
    lost: int = 0
    """Lines claimed and not sent whose lease was taken back while the feeder was away (a pause past its lease):
    dropped, not sent (another feeder sends them)."""
    samples: list[tuple[float, float, float, int]] = field(default_factory=list)
    """The last (time, vLLM running, vLLM waiting, our lines in flight) samples, newest last (at most 600): where
    vLLM holds less than we sent, its front end lags (with short answers, by as much as half of what was sent)."""


class Feeder:
    def __init__(self, store: Store, url: str, gate: Gate, *, policy: Policy, adapt: bool = True,
                 max_attempts: int = 5, request_timeout_s: float = 600.0, settle: bool = True,
                 lease_s: float = LEASE_S, role: TenantRole = TenantRole.batch, spread: bool = False,
                 resume_partial: bool = True) -> None:
        self.store, self.url, self.gate = store, url.rstrip("/"), gate
        self.role = role
        """Which batches this tenant answers (users' or the policy's validation runs)."""
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        """Whose lines these are in the store (one queue, several nodes): renewed while the feeder lives."""
        self.lease_s, self.policy, self.adapt = lease_s, policy, adapt
        self.max_attempts, self.request_timeout_s = max_attempts, request_timeout_s
        self.settle, self.resume_partial = settle, resume_partial
        """This feeder also ends batches on their window and cancels (one per service does); a cut line continues
        from what it generated (``timeslice.batch.resume_partial``)."""
        self.stats, self.healthy, self.problem = FeederStats(limit=policy.start), True, ""
        """``healthy``: False once one of the feeder's tasks died (the database full, a bug): ``/health`` says so."""
        self._outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
        self._room = asyncio.Event()
        self.waker = Waker(self._room)  # told by the database that lines became claimable (``woken``: how often)
        self._ready: collections.deque[Line] = collections.deque()
        """Lines claimed (in flight in the store) and not sent yet."""
        self._claiming = False
        self._sure_at = 0.0
        """When (monotonic) the lines claimed and not sent were last known to be this feeder's: a claim of lines into
        an empty ``_ready``, or a renewal (both from their start)."""
        self._tasks: list[asyncio.Task] = []
        self._sending: dict[asyncio.Task, Line] = {}
        """The sends in flight, oldest first."""
        self._shedding: set[asyncio.Task] = set()
        self._shed_lines: list[Line] = []
        self.spread = spread
        """Sends released at the limit's pace (:mod:`timeslice_verl.batch.pacing`), not all at once."""
        self._pacer, self.latency, self.valley = Pacer(), Latency(), Valley(gate.seconds_open)  # valley: GPU-s per send
        self._sent_at: dict[asyncio.Task, float] = {}
        """Each send's start, in the gate's open seconds (an answer held through a trainer's turn took no longer)."""

    def kick(self) -> None:
        """New lines (a batch was created): look for work now."""
        self._room.set()

    async def run(self) -> None:
        """Feed until cancelled (the service queued again what a killed one left in flight, before any feeder)."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(self.url, connector=connector, timeout=timeout) as session:
            parts = {"gate": self.gate.run(session), "writer": self._writer(), "feed": self._feed(session),
                     "lease": self._renew()}
            if self.settle:
                parts["settler"] = self._settler()
            if self.adapt:
                parts["limit"] = self._follow(session)
            self._tasks = [asyncio.create_task(c, name=f"batch-{n}") for n, c in parts.items()]
            self.waker.start(self.store)
            try:
                done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        self._died(task)
                await asyncio.Event().wait()  # keep the session for the lines in flight until cancelled
            finally:
                for task in self._tasks:
                    task.cancel()
                await self.waker.close()

    def _died(self, task: asyncio.Task) -> None:
        exc = task.exception()
        self.healthy = False
        self.problem = f"the feeder's {task.get_name()} task stopped: {type(exc).__name__}: {exc}"
        log.error("batch: %s; lines are held until the service is restarted", self.problem, exc_info=exc)

    async def _feed(self, session: aiohttp.ClientSession) -> None:
        """Send from the lines claimed ahead whenever a slot is free; claim the next ones in the background, so a
        slow database moment (a checkpoint, a large write) never leaves the tenant without work. Lines claimed but
        not sent go back to the queue when the gate closes (a cancel meanwhile can end their batch)."""
        while True:
            if not self.gate.open:
                if self._ready:
                    held, self._ready = list(self._ready), collections.deque()
                    await self._db(self.store.release, held)
                await self.gate.wait_open()
            if self._ready and time.monotonic() - self._sure_at > self.lease_s / 2:  # a pause: are they still ours?
                await self._confirm()
            free = self.stats.limit - self.stats.inflight
            go = self._allowed(min(free, len(self._ready)))
            for _ in range(go):
                self._launch(session, self._ready.popleft())
            free -= go
            if len(self._ready) < self.stats.limit and not self._claiming:
                self._claiming = True
                spawn(self._claim(self.stats.limit - len(self._ready) + max(0, free)), "batch-claim")
            self._room.clear()
            wait = self.waker.poll_s if free > 0 and not self._ready else 0.2 if free <= 0 else \
                min(0.2, max(0.001, self._pacer.wait_s(self.stats.limit, self.latency.mean_s)))  # the pacer's next send
            with contextlib.suppress(asyncio.TimeoutError):  # a slot, claimed lines, a new batch, a backoff
                await asyncio.wait_for(self._room.wait(), timeout=wait)

    async def _claim(self, n: int) -> None:
        start, woken = time.monotonic(), self.waker.woken
        try:
            lines = await self._db(self.store.claim, n, self.holder, self.lease_s, self.role)
            if not self._ready:
                self._sure_at = start
            self._ready.extend(lines)
        finally:
            self._claiming = False
        if lines or self.waker.woken != woken:  # lines, or told of some while this claim ran: look again now
            self._room.set()

    def _launch(self, session: aiohttp.ClientSession, line: Line) -> None:
        self.stats.inflight += 1
        self.stats.sent += 1
        task = asyncio.create_task(self._try(session, line))
        self._sending[task] = line
        self._sent_at[task] = self.valley.start(task)  # the gate's open seconds now
        task.add_done_callback(functools.partial(self._sent, session))

    def _allowed(self, want: int) -> int:
        """How many of ``want`` sends may go now: all, unless sends are spread."""
        if not self.spread:
            return max(0, want)
        return self._pacer.allow(time.monotonic(), want, self.stats.limit, self.latency.mean_s)

    def shed(self, to: int | None = None) -> int:
        """Cancel the newest sends past ``to`` (default: the limit; they lost the least); how many. Their lines go
        back to the queue (:meth:`_sent`), the try not counted."""
        excess = self.stats.inflight - len(self._shedding) - (self.stats.limit if to is None else to)
        if excess <= 0:
            return 0
        newest = [task for task in reversed(self._sending) if task not in self._shedding][:excess]
        for task in newest:
            self._shedding.add(task)
            task.cancel()
        self.stats.shed += len(newest)
        return len(newest)

    def _sent(self, session: aiohttp.ClientSession, task: asyncio.Task) -> None:
        """A send ended: its slot is free now (its outcome is written behind it). A done callback, not the send's
        own ``finally``: a send cancelled before it ever ran has none."""
        line, sent_at = self._sending.pop(task), self._sent_at.pop(task)
        ended_at = self.valley.end(task, line.batch_id, line.owner)  # the gate's open seconds, read once
        shed = task in self._shedding
        self._shedding.discard(task)
        self.stats.inflight -= 1
        outcome: Outcome | None = None
        if not task.cancelled():
            exc = task.exception()
            if exc is not None:
                log.error("batch: sending line %s of %s failed unexpectedly", line.custom_id, line.batch_id, exc_info=exc)
            outcome = self._again(line, f"{type(exc).__name__}: {exc}") if exc is not None else task.result()
        if outcome is not None and outcome.state == "done":  # its time with the gate open: a pause is not the server's
            self.latency.add(ended_at - sent_at)
        if self.gate.open and self._ready and self.stats.inflight < self.stats.limit:
            if self._allowed(1):
                self._launch(session, self._ready.popleft())  # the freed slot's next line, without a wake-up
            else:
                self._room.set()  # the pacer holds it: the feed loop sends it when the pacer lets it
        if len(self._ready) * 2 < self.stats.limit:
            self._room.set()  # time to claim ahead
        if outcome is not None:
            self.stats.answered += 1
            self._outcomes.put_nowait(outcome)
        elif shed:
            self._shed_lines.append(line)
            if len(self._shed_lines) == 1:
                spawn(self._release_shed(), "batch-release-shed")
        # else the service stops: the line's lease lapses and it goes back to the queue then

    async def _release_shed(self) -> None:
        await asyncio.sleep(0)  # the rest of this shedding's sends join the one transaction
        lines, self._shed_lines = self._shed_lines, []
        await self._db(self.store.release, lines)
        self._room.set()

    async def _try(self, session: aiohttp.ClientSession, line: Line) -> Outcome:
        try_ = resume.plan(line.endpoint, line.body, line.partial, self.resume_partial)
        if try_.answer is not None and try_.partial is not None:  # what was kept used its whole budget
            return Outcome.answer(line, try_.answer, try_.partial.usage)
        self.stats.resumed += try_.partial is not None
        try:
            async with session.post(line.endpoint, data=try_.body, headers=JSON_HEADERS) as resp:
                status, raw, rid = resp.status, await resp.read(), resp.headers.get("x-request-id", "")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if isinstance(exc, (aiohttp.ClientConnectionError, OSError)) and not isinstance(exc, asyncio.TimeoutError):
                self.gate.suspect(session, why)
            return self._again(line, why)
        body, text = parsed(raw)
        fate, why = classify(status, body)
        if fate == "done" and try_.rewrites:
            body = resume.merged(try_, body)
            text = json.dumps(body)
        response = f'{{"status_code": {status}, "request_id": {json.dumps(rid)}, "body": {text}}}'
        if fate == "done":
            return Outcome.answer(line, response, body.get("usage"))
        if fate == "again":
            kept = resume.cut(line.endpoint, try_, body, rid) if why == ABORTED else None
            if kept is not None:
                self.stats.kept += kept.tokens - (try_.partial.tokens if try_.partial else 0)
            return self._again(line, why, kept)
        if try_.partial is not None:  # the continued request refused: the line starts again, what was kept dropped
            return self._again(line, f"{why} on the continued request: {refused(status, body, text, why)}", restart=True)
        return Outcome(line, "failed", response=response, error=refused(status, body, text, why))

    def _again(self, line: Line, why: str, kept: resume.Partial | None = None, restart: bool = False) -> Outcome:
        """Queued again after a backoff; a try that ``kept`` output is not counted (each keeps a token more)."""
        if line.attempts >= self.max_attempts and kept is None:
            error = {"code": "attempts_exhausted", "message": f"{line.attempts} attempt(s), the last: {why}"}
            return Outcome(line, "failed", error=json.dumps(error), cut=why == ABORTED)
        delay = LINE_AGAIN.after(line.attempts)
        log.debug("batch: line %s of %s again in %.1f s (%s)", line.custom_id, line.batch_id, delay, why)
        return Outcome(line, "queued", delay_s=delay, partial=kept and kept.dumps(), restart=restart, cut=why == ABORTED)

    async def _db(self, fn: Any, *args: Any) -> Any:
        """Run a store call off the loop; while the database cannot be written (the disk full, locked) retry with a
        backoff and report unhealthy, so ``/health`` says why and the work resumes once it can be written."""
        delay = 0.0
        while True:
            try:
                result = await asyncio.to_thread(fn, *args)
            except StoreUnavailable as exc:
                if self.healthy:
                    log.error("batch: the database %s cannot be written (%s): holding, trying again", self.store.path, exc)
                self.healthy, self.problem = False, f"the database {self.store.path} cannot be written: {exc}"
                delay = STORE_AGAIN.next(delay)
                await asyncio.sleep(delay)
                continue
            if not self.healthy:
                log.info("batch: the database can be written again")
                self.healthy, self.problem = True, ""
            return result

    async def _writer(self) -> None:
        """The one writer: what arrived while the last transaction ran goes in the next one."""
        while True:
            batch = [await self._outcomes.get()]
            if self._outcomes.qsize() < WRITE_GATHER:
                await asyncio.sleep(GATHER_S)  # the slots are free already: a few ms more makes one transaction of many
            while len(batch) < WRITE_MAX and not self._outcomes.empty():
                batch.append(self._outcomes.get_nowait())
            await self._db(self.store.record, batch, self.valley.take())
            self.stats.written += len(batch)
            self.stats.writes += 1
            if any(o.state == "queued" for o in batch):
                self._room.set()

    async def _renew(self) -> None:
        """Keep the lease of every line this feeder holds (sent, or claimed and not sent yet) while it lives: a
        feeder that is gone stops renewing, and its lines go back to the queue when the lease runs out."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            if self.stats.inflight or self._ready:
                await self._confirm()

    async def _confirm(self) -> None:
        """Renew the leases; drop the lines claimed and not sent that are no longer this feeder's (taken back while
        it was away, another feeder's now): sent, they would be answered twice, the second answer discarded."""
        start = time.monotonic()
        held = await self._db(self.store.renew, self.holder, self.lease_s)
        kept = collections.deque(ln for ln in self._ready if (ln.batch_id, ln.idx, ln.token) in held)
        if len(kept) < len(self._ready):
            lost = len(self._ready) - len(kept)
            self.stats.lost += lost
            log.warning("batch: %d line(s) claimed and not sent were taken back while this feeder was away (their "
                        "lease ran out): dropped", lost)
        self._ready, self._sure_at = kept, start

    async def _settler(self) -> None:
        while True:
            await self._db(self.store.settle_open)
            await asyncio.sleep(SETTLE_S)

    async def _follow(self, session: aiohttp.ClientSession) -> None:
        """Sample the tenant's ``/metrics`` while the gate is open; move the limit by the policy
        (:class:`~timeslice_verl.batch.concurrency.Follower`: the rate only over intervals the gate stayed open
        through — a sleeping tenant generates nothing)."""
        follower = Follower(self.policy)
        while True:
            if not self.gate.open:
                follower.closed()
                await self.gate.wait_open()
            sample = await self._sample(session)
            if sample is None or not self.gate.open:
                follower.lost()
            else:
                before = self.stats.limit
                self.stats.limit, rate = follower.step(time.monotonic(), sample, before, self.stats.inflight,
                                                       self.stats.answered)
                self.stats.samples = [*self.stats.samples[-599:],
                                      (time.time(), sample.running, sample.waiting, self.stats.inflight)]
                if self.stats.limit != before:
                    shed = self.shed(shed_to(self.stats.limit, follower.climb)) if self.stats.limit < before else 0
                    log.info("batch: in flight %d -> %d (vLLM running %.0f, waiting %.0f of %d sent, %s tokens/s)%s",
                             before, self.stats.limit, sample.running, sample.waiting, self.stats.inflight,
                             f"{rate:.0f}" if rate else "?",
                             f": the {shed} newest sends cancelled, their lines queued again" if shed else
                             ": what is in flight drains" if self.stats.inflight > self.stats.limit else "")
                    self._room.set()
            await asyncio.sleep(SAMPLE_S)

    @staticmethod
    async def _sample(session: aiohttp.ClientSession) -> Sample | None:
        try:
            async with session.get("/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return parse_metrics(await resp.text()) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
            return None


__all__ = ["Feeder", "FeederStats", "classify"]
