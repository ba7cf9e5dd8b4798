"""The in-flight limit in a closed loop: the feeder's own loop (:class:`Follower`, :func:`next_limit`,
:func:`shed_to`) against a model of the tenant built from the capacity curves the H200 measured on 2026-12-02
(under `benchmarks/results/` at commit a0e5a83), with the window-to-window noise those runs showed. Seeded:
what is asserted is where the limit settles, not a speed. A guard on the loop, not a replay of those runs: their
noise was not only random (answers in waves, an API server that lags its queue), and this model lets 9a415b0's
bars pass too; with no bars at all (``fail`` and ``down_gain`` 0) the limit overshoots and a 512-most curve gets
0.944 of its best."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from timeslice_verl.batch.concurrency import Follower, Policy, Sample, shed_to

STEP_S = 0.5
NOISE = 0.08
"""Each 0.5 s interval's tokens drawn ±8 % (one sigma): 2 s windows at one limit then read ~10 % apart (the
first machine's read 9–25 %)."""

CURVES = {
    # tokens per answer, {running: tokens/s}: the mean of the passes before and after the time-sliced rows (the first
    # machine's 512 level, which never held a steady window, by its whole rate); 1024 not measured: assumed falling on
    # by the same step on the first machine, flat on the other.
    "512-token, first machine: most at 256": (512, {128: 24785, 256: 25925, 512: 20935, 1024: 15000}),
    "512-token, second machine: most at 512": (512, {128: 31451, 256: 42331, 512: 46563, 1024: 46563}),
    "48-token, second machine: most at 512": (48, {128: 21949, 256: 23470, 512: 27514, 1024: 27514}),
}


def _rate(curve: dict[int, float], running: float) -> float:
    points = sorted(curve)
    if running <= points[0]:
        return curve[points[0]] * running / points[0]
    for lo, hi in itertools.pairwise(points):
        if running <= hi:
            x = (math.log2(running) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return curve[lo] + x * (curve[hi] - curve[lo])
    return curve[points[-1]]


def _run(mix: int, curve: dict[int, float], seed: int, valleys: int = 12) -> tuple[float, float, int]:
    """Valleys of 3–5 s between trainer steps of 1–1.5 s (``fleet``'s); every answer refilled at once up to the limit;
    a fall cancels or drains as :func:`shed_to` says, a cancelled send losing half its tokens. The share of the best
    level's tokens per open second, the limit's median over the later half, the sends cancelled."""
    rnd = random.Random(seed)
    follower, limit = Follower(Policy(start=256)), 256
    inflight, generated, answered, good, open_s, shed, t = 256, 0.0, 0, 0.0, 0.0, 0, 0.0
    later: list[int] = []
    for v in range(valleys):
        follower.closed()
        t += rnd.uniform(1.0, 1.5)
        for _ in range(int(rnd.uniform(3.0, 5.0) / STEP_S)):
            inflight = max(inflight, limit)
            tokens = _rate(curve, inflight) * STEP_S * max(0.0, 1 + rnd.gauss(0, NOISE))
            generated, good, open_s, t = generated + tokens, good + tokens, open_s + STEP_S, t + STEP_S
            answered += int(tokens / mix)
            if inflight > limit:  # draining: the answers are not replaced
                inflight = max(limit, inflight - int(tokens / mix))
            new, _ = follower.step(t, Sample(inflight, 0, None, generated), limit, inflight, answered)
            if new < limit:
                cut = max(0, inflight - shed_to(new, follower.climb))
                inflight, shed, good = inflight - cut, shed + cut, good - cut * mix / 2
            limit = new
            if v >= valleys // 2:
                later.append(limit)
    return good / open_s / max(curve.values()), statistics.median(later), shed


@pytest.mark.parametrize("name, settles, share", [
    ("512-token, first machine: most at 256", (170, 384), 0.90),
    ("512-token, second machine: most at 512", (512, 1024), 0.95),
    ("48-token, second machine: most at 512", (512, 1024), 0.95),
])
def test_the_limit_settles_where_the_measured_curve_gives_most_through_window_noise(name, settles, share):
    """On the first machine the limit walked down to 113–170 on 2 s windows; on the second it stopped at 256–384
    where 512 gave most.
    Over 20 seeded runs of 12 valleys, the limit's later median lies where this curve gives most, and the valleys
    get at least ``share`` of the best level's tokens on average."""
    mix, curve = CURVES[name]
    runs = [_run(mix, curve, seed) for seed in range(20)]
    medians = [limit for _, limit, _ in runs]
    assert settles[0] <= statistics.median(medians) <= settles[1], sorted(medians)
    assert statistics.mean(s for s, _, _ in runs) >= share, [round(s, 3) for s, _, _ in runs]
