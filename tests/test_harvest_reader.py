"""The harvest reader's pure part: what a row's valleys read (the CPU's pace, vLLM's step, its running batch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks import their siblings

from readers.harvest import in_valleys


def _sample(t: float, itl_sum: float, itl_count: float, running: float = 100.0, pace: float | None = 5.0) -> dict:
    return {"t": t, "itl_sum": itl_sum, "itl_count": itl_count, "running": running, "cpu_rate": pace}


@pytest.mark.parametrize(("samples", "valleys", "want"), [
    pytest.param(  # 10 ms a step in every pair: the pace and running batch their means
        [_sample(0.0, 0, 0, 90, 4.0), _sample(0.1, 1.0, 100, 110, 6.0), _sample(0.2, 2.0, 200, 100, None)],
        [{"start": 0.0, "seconds": 0.2}], (5.0, 10.0, 100.0), id="steady"),
    pytest.param(  # a request held over a pause: one gap of 4 s in one pair; the median step does not carry it
        [_sample(0.0, 0, 0), _sample(0.1, 4.0 + 0.99, 100), _sample(0.2, 5.99, 200), _sample(0.3, 6.99, 300)],
        [{"start": 0.0, "seconds": 0.3}], (5.0, 10.0, 100.0), id="a pause's gap"),
    pytest.param(  # samples outside the valleys and a pair across two valleys (more than 0.2 s apart) left out
        [_sample(0.0, 0, 0), _sample(0.1, 1.0, 100), _sample(0.5, 50.0, 110, 500, 1.0), _sample(1.0, 60.0, 200),
         _sample(1.1, 62.0, 300)],
        [{"start": 0.0, "seconds": 0.1}, {"start": 1.0, "seconds": 0.1}], (5.0, 15.0, 100.0), id="two valleys"),
])
def test_in_valleys(samples, valleys, want):
    pace, step, running = in_valleys(samples, valleys)
    assert (round(pace, 3), round(step, 3), round(running, 3)) == want
