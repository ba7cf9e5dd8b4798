"""The feeder's in-flight limit against a modelled vLLM, valley by valley: does what the limit's controller does cost
more of the valleys the longer they are?

The controller is the service's own (:class:`timeslice_verl.batch.concurrency.Follower`, sampled every
``feeder.SAMPLE_S`` while the gate is open, with ``shed_to`` cancelling the newest sends when the limit falls); the
server is a model, stepped every ``--dt`` seconds: every running request gains a token per decode step, a step takes
``step_s × max(1, running / knee) ** alpha`` (flat while memory-bound, slower past the compute knee), at most
``max_num_seqs`` run and the rest wait, and a front end that admits at most ``admit_per_s`` requests a second (vLLM's
API server, which sets the pace of short answers). A yield pauses it keeping its requests (``mode=keep``), as a
resident trainer's valleys do. Per row (valley length × answer length): the tokens generated while the gate was
open over the best steady rate of the fixed limits the harvest benchmark's capacity pass tries (32, 128, 256, 512),
for the controller started as the harvest benchmark starts it, and for a limit held where it started. ::

    python benchmarks/follower_sim.py [--shapes rising,flat,gentle,steep,bound] [--valleys 2,4,8,12]
        [--lengths 48,512,2048] [--steps 8] [--start 256] [--drift 0.02] [--out sim.json] [--record DIR]

Deterministic (the pace's wander is seeded): the same arguments give the same table.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from timeslice_verl.batch.concurrency import Follower, Policy, Sample, shed_to  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readers.common import add_record_arguments, record  # noqa: E402

SAMPLE_S = 0.5
"""The feeder's ``SAMPLE_S`` (kept here so that the model needs no aiohttp)."""
LEVELS = (32, 128, 256, 512)


@dataclass(frozen=True)
class Server:
    """A vLLM of a 7 B model on one GPU, roughly: 15 ms decode steps up to 128 running, slower past it."""

    step_s: float = 0.015
    knee: int = 128
    alpha: float = 0.9
    max_num_seqs: int = 256
    admit_per_s: float = 2000.0
    drift: float = 0.0
    """The server's own pace wanders: each 0.5 s a step of this standard deviation, within ±15 % (vLLM's pace moved
    by up to a quarter between passes minutes apart on an H200)."""

    def step(self, running: int) -> float:
        return self.step_s * max(1.0, running / self.knee) ** self.alpha


SHAPES = {
    "rising": Server(alpha=0.9, max_num_seqs=512),
    "flat": Server(alpha=1.0, max_num_seqs=512),
    "gentle": Server(alpha=1.15, max_num_seqs=512),
    "steep": Server(alpha=1.5, max_num_seqs=512),
    "bound": Server(alpha=0.9, max_num_seqs=256),
}
"""Past the knee (128 running) the rate rises on slowly, stays flat (an API server that sets the pace), falls by a
tenth or by a third per doubling; or vLLM runs at most 256 at once."""


@dataclass
class State:
    """The server's requests (tokens left, in order of sending) and the feeder's counts."""

    running: list[float] = field(default_factory=list)
    waiting: collections.deque = field(default_factory=collections.deque)
    generated: float = 0.0
    answered: int = 0
    admit_credit: float = 0.0
    cancelled_tokens: float = 0.0
    pace: float = 1.0
    clock: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(1))

    @property
    def inflight(self) -> int:
        return len(self.running) + len(self.waiting)


def advance(server: Server, s: State, dt: float) -> None:
    """``dt`` seconds of the server: admissions, then one slice of decoding for every running request."""
    s.admit_credit = min(s.admit_credit + server.admit_per_s * dt, server.admit_per_s)
    while s.waiting and len(s.running) < server.max_num_seqs and s.admit_credit >= 1:
        s.running.append(float(s.waiting.popleft()))
        s.admit_credit -= 1
    s.clock += dt
    if server.drift and s.clock >= 0.5:
        s.clock = 0.0
        s.pace = min(1.15, max(0.85, s.pace + s.rng.gauss(0.0, server.drift)))
    if not s.running:
        return
    per = s.pace * dt / server.step(len(s.running))
    kept = []
    for left in s.running:
        got = min(per, left)
        s.generated += got
        if left - got > 1e-9:
            kept.append(left - got)
        else:
            s.answered += 1
    s.running = kept


def shed(s: State, keep: int) -> None:
    """Cancel the newest sends past ``keep``: waiting ones first (the newest), then running ones (their tokens lost)."""
    while s.inflight > keep and s.waiting:
        s.waiting.pop()
    while s.inflight > keep and s.running:
        left = s.running.pop()
        s.cancelled_tokens += left  # what it had made is generated again by the line's next try: counted as lost


def run(server: Server, length: int, valley_s: float, train_s: float, steps: int, start: int, follow: bool,
        dt: float) -> dict[str, float]:
    """``steps`` valleys of ``valley_s`` (the gate open) between ``train_s`` of training (paused, requests kept)."""
    s, limit, follower = State(), start, Follower(Policy(start=start))
    open_s, t, limits = 0.0, 0.0, []
    for _ in range(steps):
        follower.closed()
        end, next_sample = t + valley_s, t
        while t < end - 1e-9:
            while s.inflight < limit:  # the feeder tops up at once
                s.waiting.append(length)
            if follow and t >= next_sample - 1e-9:
                sample = Sample(float(len(s.running)), float(len(s.waiting)), None, s.generated)
                before = limit
                limit, _ = follower.step(t, sample, limit, s.inflight, s.answered)
                if limit < before:
                    shed(s, shed_to(limit, follower.climb))
                next_sample += SAMPLE_S
            advance(server, s, dt)
            t += dt
            open_s += dt
            limits.append(limit)
        t += train_s  # paused: nothing moves, nothing is sent
    return {"tokens": s.generated, "open_s": open_s, "answered": s.answered, "mean_limit": sum(limits) / len(limits),
            "last_limit": limit, "min_limit": min(limits), "lost_tokens": s.cancelled_tokens}


def capacity(server: Server, length: int, dt: float, seconds: float = 30.0) -> dict[int, float]:
    """The steady rate at each fixed limit: the second half of ``seconds`` with the gate open throughout."""
    rates = {}
    for level in LEVELS:
        s = State()
        t, half_tokens = 0.0, None
        while t < seconds:
            while s.inflight < level:
                s.waiting.append(length)
            advance(server, s, dt)
            t += dt
            if half_tokens is None and t >= seconds / 2:
                half_tokens = s.generated
        rates[level] = (s.generated - (half_tokens or 0.0)) / (seconds / 2)
    return rates


def rows(args: argparse.Namespace) -> list[dict]:
    """Every shape × answer length × valley: the controller and a limit held at the start, over the best fixed level."""
    out = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name} is not one of {', '.join(SHAPES)}")
        server = replace(SHAPES[name], drift=args.drift)
        for length in (int(x) for x in args.lengths.split(",")):
            cap = capacity(replace(server, drift=0.0), length, args.dt)
            best = max(cap.values())
            for valley in (float(x) for x in args.valleys.split(",")):
                got = {mode: run(server, length, valley, args.train_s, args.steps, args.start, mode == "follow",
                                 args.dt) for mode in ("follow", "fixed")}
                out.append({"shape": name, "length": length, "valley_s": valley, "capacity": cap, "best": best,
                            **{f"{m}_vs_capacity": round(g["tokens"] / g["open_s"] / best, 3) for m, g in got.items()},
                            "follow": got["follow"], "fixed": got["fixed"]})
    return out


def row_table(got: list[dict]) -> str:
    """Every row: the shape, the answers, the valley, and both feeders over capacity."""
    lines = ["| shape | answer tokens | valley s | best level (tok/s) | controller / capacity | held at start / capacity "
             "| controller's mean limit (min–last) |", "|---|---|---|---|---|---|---|"]
    for r in got:
        f, level = r["follow"], max(r["capacity"], key=r["capacity"].get)
        lines.append(f"| {r['shape']} | {r['length']} | {r['valley_s']:g} | {level} ({r['best']:.0f}) | "
                     f"{r['follow_vs_capacity']} | {r['fixed_vs_capacity']} | {f['mean_limit']:.0f} "
                     f"({f['min_limit']}–{f['last_limit']}) |")
    return "\n".join(lines)


def summary_table(got: list[dict]) -> str:
    """Per valley length: both feeders' mean over the rows, and the controller's worst row."""
    valleys = sorted({r["valley_s"] for r in got})
    lines = ["| valley s | " + " | ".join(f"{v:g}" for v in valleys) + " |", "|---|" + "---|" * len(valleys)]
    for key, label in (("follow_vs_capacity", "controller, mean"), ("fixed_vs_capacity", "held at start, mean")):
        means = [sum(r[key] for r in got if r["valley_s"] == v) / sum(1 for r in got if r["valley_s"] == v)
                 for v in valleys]
        lines.append(f"| {label} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    worst = [min(r["follow_vs_capacity"] for r in got if r["valley_s"] == v) for v in valleys]
    lines.append("| controller, worst | " + " | ".join(f"{m:.3f}" for m in worst) + " |")
    return "\n".join(lines)


def table(got: list[dict]) -> str:
    return row_table(got) + "\n\n" + summary_table(got)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--valleys", default="2,4,8,12", help="seconds the gate is open, comma-separated")
    parser.add_argument("--lengths", default="48,512,2048", help="tokens per answer, comma-separated")
    parser.add_argument("--train-s", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--start", type=int, default=256, help="the limit the feeder starts at (the default's)")
    parser.add_argument("--drift", type=float, default=0.02, help="the server's pace wanders (0: steady)")
    parser.add_argument("--dt", type=float, default=0.01)
    parser.add_argument("--out", type=Path, help="every row as JSON (sim.json)")
    add_record_arguments(parser)
    args = parser.parse_args(argv)
    got = rows(args)
    out = args.out or (Path(tempfile.mkdtemp(prefix="follower-sim-")) / "sim.json" if args.record else None)
    if out:
        keep = {k: v for k, v in vars(args).items() if k not in ("out", "record")}
        out.write_text(json.dumps({"args": keep, "rows": got}, indent=1))
    print(table(got))
    if args.record and out:
        record(args, "follower-sim", [out], "the feeder's in-flight limit against a modelled vLLM of five shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
