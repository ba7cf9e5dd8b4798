"""Which lines a claim takes, when several batches wait: pure, table-tested (``tests/test_cluster_queue.py``).

The highest priority first (validation above users' work); within one priority the owners (API keys) share: the
owner with the fewest lines in flight gets the next line, so a key that submitted one small batch is not queued
behind another's fifty thousand lines; within an owner, its batches in creation order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    """An open batch as a claim sees it."""

    id: str
    priority: int
    owner: str
    seq: int
    """Creation order."""
    queued: int
    inflight: int


def plan(batches: list[Waiting], n: int) -> list[tuple[str, int]]:
    """``(batch id, lines)`` to claim, at most ``n`` in all, in the order they are taken."""
    out: list[tuple[str, int]] = []
    ordered = sorted(batches, key=lambda b: (-b.priority, b.seq))
    for _, level in itertools.groupby(ordered, key=lambda b: b.priority):
        if n <= 0:
            break
        given = _share(list(level), n)
        out += [(bid, k) for bid, k in given if k]
        n -= sum(k for _, k in given)
    return out


def _share(level: list[Waiting], n: int) -> list[tuple[str, int]]:
    """Split ``n`` among the owners of one priority: each next line to the owner with the fewest in flight (ties: the
    owner whose first batch is older), then each owner's share over its batches in creation order."""
    owners: dict[str, list[Waiting]] = {}
    for b in level:  # already in creation order
        owners.setdefault(b.owner, []).append(b)
    load = {o: sum(b.inflight for b in bs) for o, bs in owners.items()}
    room = {o: sum(b.queued for b in bs) for o, bs in owners.items()}
    first = {o: bs[0].seq for o, bs in owners.items()}
    share = dict.fromkeys(owners, 0)
    for _ in range(n):
        able = [o for o in owners if share[o] < room[o]]
        if not able:
            break
        pick = min(able, key=lambda o: (load[o] + share[o], first[o]))
        share[pick] += 1
    out: list[tuple[str, int]] = []
    for o, bs in owners.items():
        left = share[o]
        for b in bs:
            k = min(left, b.queued)
            out.append((b.id, k))
            left -= k
    return sorted(out, key=lambda x: next(b.seq for b in level if b.id == x[0]))


__all__ = ["Waiting", "plan"]
