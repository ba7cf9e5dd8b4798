"""``timeslice.handoff.swap=auto``: the fastest swap each node can afford. Pure.

``park`` copies the ranks' tensors to pinned host RAM at copy-engine speed (tens of GB/s) but pins as much
host RAM as they hold on the GPU, for the whole run; ``checkpoint`` needs no pinned RAM but moves the
whole process through the CUDA driver (a few GB/s). ``auto`` parks when every host has what its ranks would
pin, with a quarter and 4 GiB to spare (the kernel's ``MemAvailable``, read on each rank's host), and
otherwise checkpoints, saying which host falls short.
"""

from __future__ import annotations

from typing import Any

SPARE_FRACTION = 0.25
SPARE_BYTES = 4 * 2**30


def host_available() -> int:
    """Host RAM the kernel says can be taken without swapping (``MemAvailable``), bytes; 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def parkable(available: int) -> int:
    """The most trainer state (bytes) a host with ``available`` bytes lets ``auto`` park."""
    return max(0, int((available - SPARE_BYTES) / (1 + SPARE_FRACTION)))


def choose(reports: list[dict[str, Any]] | None) -> tuple[str, str]:
    """(swap, why) from one ``release_caches`` report per rank (``host``, ``live_after``, ``host_available``);
    None: the ranks cannot park."""
    if reports is None:
        return "checkpoint", "the ranks cannot park"
    need: dict[str, int] = {}
    room: dict[str, int] = {}
    for r in reports:
        host = str(r.get("host", "?"))
        need[host] = need.get(host, 0) + int(r.get("live_after", 0))
        room[host] = int(r.get("host_available", 0))
    if not need:
        return "checkpoint", "no rank reported its memory"
    if not any(need.values()):
        return "checkpoint", "the ranks hold no GPU memory (no CUDA here?)"
    short = [f"{h} needs {need[h] / 2**30:.1f} GiB pinned, {room[h] / 2**30:.1f} GiB available" for h in sorted(need)
             if need[h] * (1 + SPARE_FRACTION) + SPARE_BYTES > room[h]]
    if short:
        return "checkpoint", "park would pin host RAM the node cannot spare: " + "; ".join(short) + \
            "; set timeslice.handoff.swap=park to force it"
    return "park", "; ".join(f"{h} pins {need[h] / 2**30:.1f} GiB of {room[h] / 2**30:.1f} GiB available" for h in sorted(need))


__all__ = ["SPARE_BYTES", "SPARE_FRACTION", "choose", "host_available", "parkable"]
