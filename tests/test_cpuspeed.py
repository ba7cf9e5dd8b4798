"""benchmarks/cpuspeed.py: a CPU's pace read by a child process beside the harvest benchmark's samples (whether the
host's clock moved under a server whose rate did)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import cpuspeed


@pytest.mark.parametrize("units, cpu_ns, want", [
    (2000, 2_000_000, 1_000_000.0),  # 2 000 units in 2 ms: a million a CPU-second
    (2000, 4_000_000, 500_000.0),
    (2000, 0, None),  # the clock did not move
    (2000, -5, None),
])
def test_rate(units: int, cpu_ns: int, want: float | None) -> None:
    assert cpuspeed.rate(units, cpu_ns) == want


@pytest.mark.parametrize("latest, first, want", [
    (1.5e6, 1.0e6, 1.5),
    (0.75e6, 1.0e6, 0.75),
    (1.0e6, 3.0e6, 0.333),
    (None, 1.0e6, None),
    (1.0e6, None, None),
    (0.0, 1.0e6, None),
])
def test_index(latest: float | None, first: float | None, want: float | None) -> None:
    assert cpuspeed.index(latest, first) == want


def test_work_is_deterministic() -> None:
    assert cpuspeed.work(500) == cpuspeed.work(500) > 0


def test_probe_reads_a_cpu_and_ends() -> None:
    """A live probe on a CPU this process may use: readings come, the first is the index's base, close ends it."""
    cpu = cpuspeed.spare_cpu()
    assert cpu in os.sched_getaffinity(0)
    probe = cpuspeed.SpeedProbe(cpu, every_s=0.01)
    try:
        first = probe.next()
        assert first > 0
        probe._readings.put(first)  # the reading back in the queue: latest() takes what waits there
        got, rate = probe.latest()  # more may have come meanwhile: their mean over the first taken
        assert got is not None and got > 0 and probe.first is not None
        assert rate is not None and rate > 0, "the rate itself, in millions a CPU-second"
    finally:
        probe.close()
    assert probe._proc.returncode is not None
    probe._thread.join(30)  # the child gone, its reader ends: what it read is all there will be
    probe.latest()
    assert probe.latest() == (None, None), "nothing new: no figure, not a zero"


def test_cli_names_a_cpu_the_host_does_not_have() -> None:
    bad = (os.cpu_count() or 1) + 1000
    proc = subprocess.run([sys.executable, str(BENCH / "cpuspeed.py"), "--cpu", str(bad)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2 and f"--cpu {bad}: not a CPU of this host" in proc.stderr


@pytest.mark.parametrize("named, want", [("", None), ("0", 0), (" 0 ", 0)])
def test_the_probes_cpu_named_or_the_last_of_ours(monkeypatch, named, want) -> None:
    monkeypatch.setenv("CPU_PROBE", named)
    assert cpuspeed.spare_cpu() == (max(os.sched_getaffinity(0)) if want is None else want)


@pytest.mark.parametrize("named", ["x", "-1", "1.5", "100000"])
def test_a_probe_cpu_that_is_not_one_says_so(monkeypatch, named) -> None:
    monkeypatch.setenv("CPU_PROBE", named)
    with pytest.raises(SystemExit, match="CPU_PROBE=.*not a CPU of this host"):
        cpuspeed.spare_cpu()
