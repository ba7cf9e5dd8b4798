"""Which lines a claim takes, when several batches wait: pure, table-tested (``tests/test_cluster_queue.py``).

The highest priority first (validation above users' work); within one priority the owners (API keys) share by
weight: the next line goes to the owner with the fewest lines in flight for its weight (its key file's ``weight``,
:mod:`~timeslice_verl.batch.policy`), so a key that submitted one small batch is not queued behind another's fifty
thousand lines, and under saturation owners hold lines in flight — and as vLLM generates one token per running
sequence per step, receive tokens — in proportion to their weights. Within an owner, its batches earliest deadline
first (``expires_at``: the end of the batch's ``completion_window``), then in creation order; owners that tie on the
share, the one with the earliest deadline first. The share between owners comes before deadlines: one key's short
windows do not starve another key's lines.
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
    weight: float = 1.0
    """Its owner's weight in the share (the same on each of that owner's batches)."""
    deadline: float = 0.0
    """When its window ends (``expires_at``): earliest first, within its owner and priority."""


def plan(batches: list[Waiting], n: int) -> list[tuple[str, int]]:
    """``(batch id, lines)`` to claim, at most ``n`` in all, in the order they are taken."""
    out: list[tuple[str, int]] = []
    ordered = sorted(batches, key=lambda b: (-b.priority, b.deadline, b.seq))
    for _, level in itertools.groupby(ordered, key=lambda b: b.priority):
        if n <= 0:
            break
        given = _share(list(level), n)
        out += [(bid, k) for bid, k in given if k]
        n -= sum(k for _, k in given)
    return out


def _share(level: list[Waiting], n: int) -> list[tuple[str, int]]:
    """Split ``n`` among the owners of one priority: each next line to the owner whose lines in flight, that one
    counted, are the fewest for its weight (ties: the owner whose earliest deadline, then first batch, comes first),
    then each owner's share over its batches, earliest deadline first."""
    owners: dict[str, list[Waiting]] = {}
    for b in level:  # already earliest deadline first, then in creation order
        owners.setdefault(b.owner, []).append(b)
    load = {o: sum(b.inflight for b in bs) for o, bs in owners.items()}
    room = {o: sum(b.queued for b in bs) for o, bs in owners.items()}
    weight = {o: max(bs[0].weight, 1e-9) for o, bs in owners.items()}
    first = {o: (bs[0].deadline, min(b.seq for b in bs)) for o, bs in owners.items()}
    share = dict.fromkeys(owners, 0)
    for _ in range(n):
        able = [o for o in owners if share[o] < room[o]]
        if not able:
            break
        pick = min(able, key=lambda o: ((load[o] + share[o] + 1) / weight[o], first[o]))
        share[pick] += 1
    out: list[tuple[str, int]] = []
    for o, bs in owners.items():
        left = share[o]
        for b in bs:
            k = min(left, b.queued)
            out.append((b.id, k))
            left -= k
    order = {b.id: i for i, b in enumerate(level)}
    return sorted(out, key=lambda x: order[x[0]])


__all__ = ["Waiting", "plan"]
