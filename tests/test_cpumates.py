"""benchmarks/cpumates.py: which CPUs of a guest share a physical core, from how each one's pace drops while another
spins — the rule that reads mates out of the slowdowns, and one real pass on this host's CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings by name

import cpumates  # noqa: E402


@pytest.mark.parametrize("slowdown, mates", [
    ({0: {1: 0.98, 2: 0.97}, 1: {0: 0.99, 2: 1.01}, 2: {0: 1.0, 1: 0.96}}, {}),  # no SMT
    ({0: {1: 0.55, 2: 0.97}, 1: {0: 0.52, 2: 1.0}, 2: {0: 1.0, 1: 0.99}}, {0: [1], 1: [0]}),  # a hidden pair
    ({0: {1: 0.55, 2: 0.97}, 1: {0: 0.95, 2: 1.0}, 2: {0: 1.0, 1: 0.99}}, {}),  # one way only: not a shared core
    ({0: {1: 0.6, 2: 0.6}, 1: {0: 0.6, 2: 1.0}, 2: {0: 0.7, 1: 1.0}}, {0: [1, 2], 1: [0], 2: [0]}),
    ({0: {1: 0.8}, 1: {0: 0.8}}, {}),  # at the threshold: not below it
])
def test_mates_are_cpus_that_slow_each_other(slowdown, mates):
    assert cpumates.find_mates(slowdown, 0.8) == mates


def test_a_pass_reads_every_cpu_beside_every_other(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"this process may use one CPU ({cpus}): no pair to measure")
    out = subprocess.run([sys.executable, str(BENCH / "cpumates.py"), "--hold", "0.2"], capture_output=True, text=True,
                         check=True, cwd=tmp_path, timeout=600)
    got = json.loads(out.stdout)
    assert got["cpus"] == cpus and got["threshold"] == 0.8
    assert sorted(int(c) for c in got["quiet"]) == cpus and all(r > 0 for r in got["quiet"].values())
    assert sorted(int(c) for c in got["slowdown"]) == cpus
    for busy, row in got["slowdown"].items():
        assert sorted(int(t) for t in row) == [c for c in cpus if c != int(busy)]  # all but the spinning one
        assert all(r > 0 for r in row.values())
    mates = {int(c): sorted(m) for c, m in got["mates"].items()}  # JSON names the CPUs as strings
    assert mates == cpumates.find_mates({int(b): {int(t): r for t, r in row.items()}
                                         for b, row in got["slowdown"].items()}, 0.8)


@pytest.mark.parametrize("argv, error", [(["--threshold", "1.5"], "a share between 0 and 1"),
                                         (["--hold", "0"], "more than 0")])
def test_bad_arguments_are_named(argv, error, capsys):
    with pytest.raises(SystemExit):
        cpumates.main(argv)
    assert error in capsys.readouterr().err
