"""A CPU's pace, read beside the harvest benchmark's samples: vLLM's engine core is one Python loop that runs a core
flat out on an H200 with a small model, so its rate is that core's pace; the same server read a third to a half apart
minutes later (an H200, 2026-12-03), on CPUs of its own with no steal. A host shared with other guests can change its
cores' clock under us without the guest seeing it (``/proc/cpuinfo`` shows a fixed figure in a VM), so this measures
it: a child process on one CPU runs a fixed piece of interpreter work (dict, list and attribute traffic, like a
scheduler's) every ``every_s`` and reports how much of it one CPU-second does (thread CPU time: waiting for the CPU
does not count, so a busy neighbour reads as contention only through shared caches). Its rate over its first reading is
the index; the sampler records it as ``cpu_speed`` (1.0: as fast as at the start), and the rate itself as ``cpu_rate``
(millions of units per CPU-second: what compares across probes).

    python benchmarks/cpuspeed.py --cpu 3 --every 0.2     # prints "<units per CPU-second>" lines until stopped
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

UNITS = 2000
"""Pieces of work per reading: ~2-4 ms of one core (a reading every 0.2 s takes 1-2 % of the CPU it is on)."""


def work(units: int) -> int:
    """A fixed amount of interpreter work: what it returns only keeps it from being optimised away."""
    table: dict[int, list[int]] = {}
    total = 0
    for i in range(units):
        row = table.setdefault(i % 97, [])
        row.append(i)
        if len(row) > 8:
            total += row.pop(0)
        total += len(table)
    return total


def rate(units: int, cpu_ns: int) -> float | None:
    """Units per CPU-second (None when the clock did not move: nothing to divide by)."""
    return units / (cpu_ns / 1e9) if cpu_ns > 0 else None


def index(latest: float | None, first: float | None) -> float | None:
    """``latest`` over ``first``, to three places (None when either is missing)."""
    return round(latest / first, 3) if latest and first else None


def probe(cpu: int, every_s: float, units: int = UNITS) -> None:
    """The child's loop: pinned to ``cpu``, a reading per ``every_s`` on stdout until its reader goes away."""
    os.sched_setaffinity(0, {cpu})
    work(units)  # warm: the first run pays for allocations the rest reuse
    while True:
        t0 = time.thread_time_ns()
        work(units)
        got = rate(units, time.thread_time_ns() - t0)
        try:
            print(f"{got:.1f}" if got else "-", flush=True)
        except BrokenPipeError:
            return
        time.sleep(every_s)  # pacing between readings, not a synchronisation


class SpeedProbe:
    """The child on ``cpu``, a thread reading its lines; :meth:`latest` is the mean of the readings since the last
    call, over the first reading (the index). Closed with :meth:`close` (the child is ended, then waited for)."""

    def __init__(self, cpu: int, every_s: float = 0.2) -> None:
        self.cpu = cpu
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--cpu", str(cpu),
                                       "--every", str(every_s)], stdout=subprocess.PIPE, text=True)
        self._readings: queue.Queue[float] = queue.Queue()
        self.first: float | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.strip() not in ("", "-"):
                self._readings.put(float(line))

    def next(self, timeout_s: float = 30.0) -> float:
        """The next reading (blocks; for tests and the first reading)."""
        return self._readings.get(timeout=timeout_s)

    def latest(self) -> tuple[float | None, float | None]:
        """(the index, the readings' mean in millions of units per CPU-second): the index compares within one probe
        (its first reading is noisy), the rate across probes of one host (passes of ``drift`` are a probe each)."""
        got = []
        while not self._readings.empty():
            got.append(self._readings.get_nowait())
        if not got:
            return None, None
        mean = sum(got) / len(got)
        if self.first is None:
            self.first = got[0]
        return index(mean, self.first), round(mean / 1e6, 4)

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def spare_cpu() -> int:
    """``CPU_PROBE`` where set (a CPU of the engine core's own, say: the pace it runs at, at the cost of a few per cent
    of that CPU), else the highest-numbered CPU this process may run on (harvest.py runs off the engine core's CPUs
    when they are pinned: a CPU of its own set is not the engine core's)."""
    named = os.environ.get("CPU_PROBE", "").strip()
    if named:
        if not named.isdigit() or int(named) >= (os.cpu_count() or 1):
            raise SystemExit(f"CPU_PROBE={named!r}: not a CPU of this host (0-{(os.cpu_count() or 1) - 1})")
        return int(named)
    return max(os.sched_getaffinity(0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", type=int, required=True, help="the CPU to run on")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between readings")
    args = parser.parse_args()
    if not 0 <= args.cpu < (os.cpu_count() or 1):
        parser.error(f"--cpu {args.cpu}: not a CPU of this host (0-{(os.cpu_count() or 1) - 1})")
    try:
        probe(args.cpu, args.every)
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # a CPU the host has but this process may not use (a cpuset)
        parser.error(f"--cpu {args.cpu}: cannot run there: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
