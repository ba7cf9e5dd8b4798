"""How many lines the feeder keeps in flight: enough that vLLM generates as fast as it can, with a short queue waiting
inside vLLM where its ``max_num_seqs`` is reached (so a freed slot is refilled at once, and a wake-up starts at full
batch), never more than the ceiling. Pure: vLLM's ``/metrics`` in, a number out; the feeder samples and applies it.

* **No queue inside vLLM** while we use our whole limit: the server could take more — grow by half (a slow start
  that reaches 512 from 32 in seven steps, doubling while each step still raises the rate by a fifth; each step
  judged on the rate over a settled window) …
* … **unless growing cost tokens**: vLLM's generation rate (``vllm:generation_tokens_total`` per second) fell by
  more than ``fail`` below the best limit's rate (read again whenever the limit is back there, so neither one lucky
  window nor a server that slowed since sets the bar): back to the limit that gave it and hold it for ``hold_s`` (far
  past the GPU's compute knee every request is slower and the steps longer); then probe again — each probe that
  failed in a row doubling the next hold (up to ``max_hold_s``) and halving the next probe's step. A limit is judged
  once a turnover of what it holds has been answered (the feeder's *settled*); a probe up already ``loss`` below the
  best on a shorter window goes back at once (a probe past a steep knee is paid for every second it stays). A rate
  about flat (from ``fail`` below to ``gain`` above) probes on in smaller steps: with short completions vLLM's API
  server, not the GPU, can set the pace, and more in flight keeps its running batch fuller between the waves of
  answers (short windows at one limit read up to a quarter apart, so a bar of ``gain`` below can stop the climb
  well short of the limit that gives the most).
* **A probe up that failed goes back and holds; a second in a row looks below once** — unless the climb reached that
  limit from a lower one it measured: the limit it started from may itself be past the knee (a start of 256 where 128
  gives the most, as a single API server with long answers can): one step down; while a step down
  raises the rate by ``down_gain`` it goes on down, else back to the best limit and hold. After the hold the search
  starts over from there, so both sides are looked at again, each time less often. Not after the first failure: one
  probe read on valley windows is weak evidence (a server whose lower limit never gave more in its capacity
  passes ran a third below its reference for a quarter of a row on looks below made after one failed probe). The bar below is higher than
  above: near the knee neighbouring limits differ by less than a window's noise, and a walk down on noise gave up a
  third of the batch.
* **What a fall cancels** (:func:`shed_to`): a probe up that cost tokens gives back its excess at once (the newest
  sends, which lost the least); a look below lets what is in flight drain — it is a question, not a loss, and
  cancelling 512-token answers half made throws their tokens away.
* **A queue longer than wanted while the server is full**: shrink to what it runs plus the wanted queue. Full: its KV
  cache nearly so, or a long queue at two samples in a row with no more running at the second (``max_num_seqs``).
  A queue behind a running count still growing is admission, not a full server: lines sent at once when a wave of
  answers ends, or the held requests re-admitted after a wake-up, wait a step or two for their prefill (shrinking
  on that one sample could take the limit to a tenth of itself for the rest of a batch).
* **KV cache nearly full** with requests waiting: hold (more would only wait or be preempted).
* Without metrics (not vLLM, or they cannot be read) the limit stays where it is.

The wanted queue is ``max(min_queue, queue_fraction × running)``: a few requests per free slot the moment one frees.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
GENERATED = ("vllm:generation_tokens_total",)
"""vLLM's names (the second: releases before 0.10)."""


@dataclass(frozen=True)
class Sample:
    running: float
    waiting: float
    kv_usage: float | None = None
    """0..1; None: not reported."""
    generated: float | None = None
    """Tokens generated since the server started (a counter); None: not reported."""


@dataclass(frozen=True)
class Climb:
    """What growing the limit has bought: the best generation rate seen, the smallest limit that gave it, and until
    when the limit holds after a growth that bought nothing."""

    best_rate: float = 0.0
    best_limit: int = 0
    hold_until: float = 0.0
    failed: int = 0
    """Probes in a row that cost tokens: each doubles the next hold and halves the next probe's step (a probe past
    the knee is paid for a whole window: past a steep knee, half the tokens of the limit below it)."""
    down: bool = False
    """Probing below the best limit (after a probe above it failed)."""
    looked_down: bool = False
    """Below the best limit was looked at since the search (re)started: a failed probe up only holds."""


@dataclass(frozen=True)
class Policy:
    start: int = 32
    ceiling: int = 512
    """``timeslice.batch.max_concurrency``: vLLM's largest CUDA-graph decode batch by default."""
    floor: int = 1
    min_queue: int = 4
    queue_fraction: float = 0.1
    kv_full: float = 0.98
    growth: float = 1.5
    gain: float = 0.05
    """A growth must raise the generation rate by this share to count."""
    fail: float = 0.10
    """A probe up fails when its settled rate is this share below the best (between the two: about flat, probe on)."""
    down_gain: float = 0.10
    """A step below the best limit must raise the generation rate by this share to count."""
    loss: float = 0.15
    """A probe up whose rate, not yet settled, is this share below the best goes back without waiting."""
    hold_s: float = 30.0
    max_hold_s: float = 600.0
    busy: float = 0.9
    """We use our limit when at least this share of it is in flight: only then can the limit be what holds vLLM back."""
    kv_high: float = 0.9
    """KV-cache usage from which a queue inside vLLM means the server is full."""

    def wanted_queue(self, running: float) -> int:
        return max(self.min_queue, math.ceil(self.queue_fraction * running))


def metric_values(text: str) -> Iterator[tuple[str, float]]:
    """(name, value) for each of vLLM's samples in its Prometheus text (``vllm:…``; labels dropped, one pair per
    labelled series); a line without a finite number is skipped."""
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            yield name, value


def parse_metrics(text: str) -> Sample | None:
    """Running and waiting requests and tokens generated (summed over the server's engines and models) and
    KV-cache usage (their mean) from vLLM's Prometheus text; None when the text has no request gauges."""
    sums = {"running": 0.0, "waiting": 0.0, "generated": 0.0}
    kv: list[float] = []
    seen, counted = False, False
    for name, value in metric_values(text):
        if name in RUNNING or name in WAITING:
            sums["running" if name in RUNNING else "waiting"] += value
            seen = True
        elif name in KV_USAGE:
            kv.append(value)
        elif name in GENERATED:
            sums["generated"] += value
            counted = True
    if not seen:
        return None
    return Sample(sums["running"], sums["waiting"], sum(kv) / len(kv) if kv else None,
                  sums["generated"] if counted else None)


def full(sample: Sample, previous: Sample | None, policy: Policy) -> bool:
    """A long queue inside vLLM because it can run no more (not because it is still admitting what just came)."""
    if sample.waiting <= 2 * policy.wanted_queue(sample.running):
        return False
    if sample.kv_usage is not None and sample.kv_usage >= policy.kv_high:
        return True
    return previous is not None and previous.waiting > 2 * policy.wanted_queue(previous.running) \
        and sample.running <= previous.running


def next_limit(limit: int, inflight: int, sample: Sample | None, policy: Policy, rate: float | None = None,
               climb: Climb = Climb(), now: float = 0.0, settled: bool = True,
               previous: Sample | None = None) -> tuple[int, Climb]:
    """The limit after one sample (``inflight``: our lines out now; ``rate``: tokens/s generated over the window the
    limit has settled for, None when unknown — the gate was closed meanwhile), and the climb's new state.
    ``settled``: the window at this limit is long enough to judge it; until then the limit only shrinks or holds
    (a one-second rate is mostly the noise of answers finishing in waves). ``previous``: the sample before, taken
    while the gate stayed open (None after it opened)."""
    def clamp(n: int) -> int:
        return max(policy.floor, min(policy.ceiling, n))

    if sample is None:
        return clamp(limit), climb
    want = policy.wanted_queue(sample.running)
    if full(sample, previous, policy):
        return clamp(int(sample.running) + want), climb
    if sample.waiting > 2 * want:  # still admitting: wait for the next sample
        return clamp(limit), climb
    if sample.kv_usage is not None and sample.kv_usage >= policy.kv_full and sample.waiting > 0:
        return clamp(limit), climb
    if not settled:
        if (rate is not None and climb.best_limit and limit > climb.best_limit and not climb.down
                and rate < climb.best_rate * (1 - policy.loss)):
            return _failed_up(climb, policy, now)
        return clamp(limit), climb
    if climb.down:
        return _down(limit, rate, climb, policy, now)
    if rate is not None and limit == climb.best_limit:  # the best limit's own rate, read again over a longer window
        climb = replace(climb, best_rate=rate)
    growth = policy.growth
    if rate is not None and rate > climb.best_rate * (1 + policy.gain):
        if climb.best_rate and rate > climb.best_rate * (1 + 4 * policy.gain):
            growth = 2.0 * policy.growth / 1.5  # far below the knee yet: a bolder step
        # a growth that paid: the failed probes are forgotten, and below it was measured on the way up (no need to
        # look there again when the next probe fails: re-reading it cost seconds of every row)
        climb = Climb(rate, limit, climb.hold_until, looked_down=climb.best_rate > 0)
    elif rate is not None and climb.best_rate:
        growth = 1 + (policy.growth - 1) / 2 ** (1 + climb.failed)  # about flat: probe on, in smaller steps
    if (rate is not None and climb.best_limit and limit > climb.best_limit and rate < climb.best_rate * (1 - policy.fail)
            and not (climb.hold_until and now >= climb.hold_until)):  # it cost tokens: back, whatever is in flight
        return _failed_up(climb, policy, now)
    if not (sample.waiting < want and inflight >= policy.busy * limit):
        return clamp(limit), climb
    if now < climb.hold_until:
        return clamp(limit), climb
    if climb.hold_until and now >= climb.hold_until:  # the hold is over: probe again from here, more gently after failures
        climb, growth = Climb(rate or 0.0, limit, failed=climb.failed), 1 + (policy.growth - 1) / 2 ** climb.failed
    return clamp(max(limit + 1, math.ceil(limit * growth))), climb


def _failed_up(climb: Climb, policy: Policy, now: float) -> tuple[int, Climb]:
    """A probe up that cost tokens: back to the limit it started from and hold; a second in a row (after the hold) looks
    once below that limit (is it itself past the knee?): one failed probe is weak evidence (the module's docstring)."""
    if not climb.looked_down and climb.failed and climb.best_limit > policy.floor:
        return max(policy.floor, math.floor(climb.best_limit / policy.growth)), replace(climb, down=True, looked_down=True)
    return _back(climb, policy, now)


def shed_to(limit: int, climb: Climb) -> int:
    """After the limit fell to ``limit``: the number in flight past which sends are cancelled. A look below keeps
    what the best limit holds (it drains as answers come); anything else, the limit itself."""
    return max(limit, climb.best_limit) if climb.down else limit


def _down(limit: int, rate: float | None, climb: Climb, policy: Policy, now: float) -> tuple[int, Climb]:
    """A probe below the best limit, judged on its settled rate: better by ``down_gain``, the new best, and one step
    further down; else back to the best limit and hold (the probe up that led here counts as failed)."""
    if rate is None:
        return max(policy.floor, limit), climb
    if rate > climb.best_rate * (1 + policy.down_gain):
        lower = max(policy.floor, math.floor(limit / policy.growth))
        if lower >= limit:
            return limit, Climb(rate, limit, looked_down=True)
        return lower, Climb(rate, limit, down=True, looked_down=True)
    return _back(climb, policy, now)


def _back(climb: Climb, policy: Policy, now: float) -> tuple[int, Climb]:
    """A probe that cost tokens (up, or the look below after it): back to the best limit, and hold it — the longer,
    the more probes in a row have failed."""
    hold = min(policy.max_hold_s, policy.hold_s * 2 ** climb.failed)
    return (max(policy.floor, min(policy.ceiling, climb.best_limit)),
            Climb(climb.best_rate, climb.best_limit, now + hold, climb.failed + 1, looked_down=True))


# ------------------------------------------------------------------ the closed loop's bookkeeping (the feeder's clock)

WINDOW_S = 3.0
"""The generation rate a limit is judged on is taken over at least this long at that limit, summed over the intervals
the gate was open (a valley may be shorter: the window goes on in the next) …"""
TURNOVER = 1.0
"""… and until this many times the limit has been answered since the window opened: with 512-token answers 2 s
windows at 256 in flight read rates 9–25 % apart (what finished in it, not the limit's own pace), and the policy walked
down on them; a probe up clearly worse is judged before (the policy's ``loss``)."""


@dataclass
class Window:
    """Tokens generated and seconds the gate was open, at one limit, and the answers counted when it opened."""

    limit: int = -1
    answered: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def settled(self, answered: int) -> bool:
        """Long enough, and a turnover of the limit answered, to judge the limit by its rate."""
        return self.seconds >= WINDOW_S and answered - self.answered >= TURNOVER * self.limit


class Follower:
    """One tenant's limit, sample by sample: what the feeder reads (the time, vLLM's sample, its own limit, lines in
    flight and answered so far) in, the next limit out. The rate is taken only over intervals the gate stayed open
    through, leaving out each valley's first (the wake's ramp), and a window opens only once a fall has drained."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.climb = Climb()
        self.window = Window()
        self._last: tuple[float, float | None] | None = None
        self._previous: Sample | None = None
        self._ramp = True

    def closed(self) -> None:
        """The gate closed: the window keeps what it has (it goes on in the next valley), whose first interval is a
        ramp."""
        self._last = self._previous = None
        self._ramp = True

    def lost(self) -> None:
        """No sample (the metrics could not be read) or the gate closed while reading: no interval spans it."""
        self._last = self._previous = None

    def step(self, now: float, sample: Sample, limit: int, inflight: int, answered: int) -> tuple[int, float | None]:
        """The limit after this sample, and the rate it was judged on (None: not yet)."""
        if self._ramp:  # the gate just opened: the first interval holds the wake's ramp, not the limit's pace
            self._ramp, self._previous = False, sample
            return limit, None
        window = self.window
        if window.limit != limit or inflight > limit:
            window = self.window = Window(limit, answered)  # opens a sample after a change, once drained
        elif self._last is not None and sample.generated is not None and self._last[1] is not None \
                and now > self._last[0]:
            window.tokens += max(0.0, sample.generated - self._last[1])
            window.seconds += now - self._last[0]
        # an interval draining a fall, or with the limit not in use (the batch ran dry, sends cancelled), is not the
        # limit's: a window read while a row's lines were being cancelled put a good limit at half its rate
        self._last = (now, sample.generated) if self.policy.busy * limit <= inflight <= limit else None
        settled = sample.generated is None or window.settled(answered)  # no counter: sample by sample
        rate = window.tokens / window.seconds if window.seconds >= WINDOW_S and sample.generated is not None else None
        new, self.climb = next_limit(limit, inflight, sample, self.policy, rate, self.climb, now, settled,
                                     self._previous)
        self._previous = sample
        return new, rate


__all__ = ["Climb", "Follower", "Policy", "Sample", "Window", "full", "next_limit", "parse_metrics", "shed_to"]
