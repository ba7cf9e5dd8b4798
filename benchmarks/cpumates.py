"""Which of this guest's CPUs share a physical core, measured: a VM can show sixteen CPUs with no SMT (sysfs lists each
CPU alone) while the hypervisor runs two of them on the two threads of one core. vLLM's engine core is one Python loop
a core flat out with a small model, and on an H200 on 2026-12-03 its pace flipped between two levels about 2x apart
within tens of seconds (``cpu_rate`` 3.0-3.6 against 6.2-7.4 on its own CPU): what a busy hidden mate does. This
finds them on a quiet machine: a probe (:mod:`cpuspeed`) on every CPU, then a busy loop on each CPU in turn; a CPU whose
probe slows by more than ``--threshold`` while the loop runs elsewhere is that CPU's mate. ``pin.py`` reads the result
(``PIN_MATES=FILE``) to give the engine core a whole physical core and keep everything else off its mate.

    python benchmarks/cpumates.py [--hold 1.0] [--threshold 0.8] > mates.json   # ~1.3 s per CPU, on an idle machine
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpuspeed import SpeedProbe  # noqa: E402


def spin(cpu: int) -> None:
    """The busy loop: one CPU flat out until terminated."""
    os.sched_setaffinity(0, {cpu})
    n = 0
    while True:
        n = (n + 1) % 1_000_003


def find_mates(slowdown: dict[int, dict[int, float]], threshold: float) -> dict[int, list[int]]:
    """CPU -> the CPUs whose busy loop slowed it below ``threshold`` of its quiet pace, kept only where the slowing
    goes both ways (a mate is mutual: one-sided slowing is noise or a shared cache, not a shared core)."""
    one_way = {target: {busy for busy, row in slowdown.items() if busy != target and row.get(target, 1.0) < threshold}
               for target in {t for row in slowdown.values() for t in row}}
    return {t: sorted(b for b in busies if t in one_way.get(b, set())) for t, busies in sorted(one_way.items())
            if any(t in one_way.get(b, set()) for b in busies)}


def _hold(probes: dict[int, SpeedProbe], hold_s: float, settle_s: float) -> dict[int, float]:
    """Each probe's mean rate over ``hold_s`` after ``settle_s`` (readings before it dropped); a probe that gave none
    in that time (a loaded host) gives its next one."""
    time.sleep(settle_s)  # the loop reaching its CPU: the window's start, not a synchronisation
    for probe in probes.values():
        probe.latest()
    time.sleep(hold_s)  # the window itself
    return {cpu: rate if (rate := probe.latest()[1]) is not None else round(probe.next() / 1e6, 4)
            for cpu, probe in probes.items()}


def measure(cpus: list[int], hold_s: float, settle_s: float = 0.3) -> dict[str, object]:
    """Quiet paces (before, between and after), then each CPU's pace while each other CPU spins."""
    probes = {cpu: SpeedProbe(cpu, every_s=0.02) for cpu in cpus}
    ctx = mp.get_context("spawn")
    try:
        for probe in probes.values():
            probe.next()
        quiet = [_hold(probes, hold_s, settle_s)]
        slowdown: dict[int, dict[int, float]] = {}
        for i, busy in enumerate(cpus):
            loop = ctx.Process(target=spin, args=(busy,), daemon=True)
            loop.start()
            try:
                got = _hold(probes, hold_s, settle_s)
            finally:
                loop.terminate()
                loop.join(10)
            slowdown[busy] = {t: rate for t, rate in got.items() if t != busy}
            if i == len(cpus) // 2:
                quiet.append(_hold(probes, hold_s, settle_s))
        quiet.append(_hold(probes, hold_s, settle_s))
    finally:
        for probe in probes.values():
            probe.close()
    base = {cpu: statistics.median(q[cpu] for q in quiet if cpu in q) for cpu in cpus if any(cpu in q for q in quiet)}
    ratios = {busy: {t: round(rate / base[t], 3) for t, rate in row.items() if base.get(t)}
              for busy, row in slowdown.items()}
    return {"cpus": cpus, "hold_s": hold_s, "quiet": {c: round(r, 4) for c, r in base.items()},
            "quiet_passes": quiet, "slowdown": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=float, default=1.0, help="seconds each CPU spins while the others are read")
    parser.add_argument("--threshold", type=float, default=0.8,
                        help="a CPU slower than this share of its quiet pace while another spins is its mate")
    args = parser.parse_args(argv)
    if not 0 < args.threshold < 1:
        parser.error(f"--threshold {args.threshold}: a share between 0 and 1")
    if args.hold <= 0:
        parser.error(f"--hold {args.hold}: seconds, more than 0")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        parser.error(f"this process may use one CPU ({cpus}): no pair to measure")
    got = measure(cpus, args.hold)
    got["threshold"] = args.threshold
    got["mates"] = find_mates(got["slowdown"], args.threshold)  # type: ignore[arg-type]
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
