"""A handoff's start, once the model is loaded: the swap ``auto`` picks, the host buffers pinned for parking, the
round trip's estimate for the first valleys, the ranks' pids registered with the agent."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from timeslice_verl.agent.client import AgentError
from timeslice_verl.handoff import swap_choice
from timeslice_verl.handoff.forecast import ValleyForecast
from timeslice_verl.handoff.ranks import RankLost, Ranks
from timeslice_verl.log import get_logger
from timeslice_verl.names import SwapMode

log = get_logger("handoff")


class Handoff(Protocol):
    """What the start reads and sets of a :class:`~timeslice_verl.handoff.sequence.Handoff` (which calls it: a
    protocol keeps the import one way)."""

    job: str
    client: Any
    """The agent's client (one node's, or a cluster's with ``register_ranks``); None on ranks that only follow."""
    ranks: Ranks | None
    swap: SwapMode | None
    """None: ``auto``, chosen here."""
    forecast: ValleyForecast


def _agreed(h: Handoff, value: Any) -> Any:
    """``value`` as every rank agrees on it (the first rank's), where the ranks share values."""
    shared = getattr(h.ranks, "shared", None)
    return shared(value) if shared is not None else value


def begin(h: Handoff) -> list[dict[str, Any]]:
    """The start (see the module); the pin reports, one per rank."""
    if h.ranks is None:
        return []
    reports = release_caches_reports(h)
    agent = swap_choice.agent_figures(agent_status(h))
    if h.swap is None:  # auto
        h.swap = _agreed(h, pick_swap(h, reports, agent))
    h.swap = SwapMode(h.swap)
    if h.swap.parks and not can_park(h.ranks):
        log.error("[timeslice] job=%s swap=%s but the ranks have no park method (is timeslice-verl installed where "
                  "the workers run?): swapping by checkpoint instead", h.job, h.swap)
        h.swap = SwapMode.checkpoint
    pinned: list[dict[str, Any]] = []
    if h.swap.parks:
        t0 = time.perf_counter()
        pinned = h.ranks.park_reserve()
        log.info("[timeslice] job=%s pinned %.2f GiB of host RAM for parking on %d rank(s) in %.1f s", h.job,
                 sum(int(r.get("pinned", 0)) for r in pinned) / 2**30, len(pinned), time.perf_counter() - t0)
    h.forecast.round_trip_estimate, why = swap_choice.round_trip_estimate(h.swap, reports, pinned, agent)
    log.info("[timeslice] job=%s round trip before any is measured: %.2f s (%s)", h.job,
             h.forecast.round_trip_estimate, why)
    register_pids(h)
    return pinned


def can_park(ranks: Any) -> bool:
    """Whether the ranks can move their own tensors (ranks without the method cannot)."""
    method = getattr(ranks, "can_park", None)
    return bool(method()) if method is not None else False


def register_pids(h: Handoff) -> None:
    assert h.ranks is not None
    if hasattr(h.client, "register_ranks"):  # across nodes: each node's agent gets its own ranks' pids
        h.client.register_ranks(h.job, h.ranks)
        return
    pids = h.ranks.local_pids()
    if not pids and h.client is not None:
        log.warning("[timeslice] job=%s the ranks' pids are unknown: the agent freezes the job's tagged processes, "
                    "the rollout side's (its process titles) excepted", h.job)
    if pids and h.client is not None:
        try:
            h.client.register_pids(h.job, pids)
            log.info("[timeslice] job=%s registered worker pids %s", h.job, pids)
        except AgentError as exc:
            log.warning("[timeslice] job=%s could not register worker pids %s: %s (tag discovery still applies)",
                        h.job, pids, exc)


def release_caches_reports(h: Handoff) -> list[dict[str, Any]] | None:
    """Every rank's memory once its caches are freed (what ``auto`` and the round-trip estimate go by)."""
    assert h.ranks is not None
    try:
        return h.ranks.release_caches()
    except RankLost:
        raise
    except Exception as exc:
        log.warning("[timeslice] job=%s the ranks' memory is unknown: %s", h.job, exc)
        return []


def agent_status(h: Handoff) -> dict[str, Any]:
    status = getattr(h.client, "status", None)
    try:
        return status() if status is not None else {}
    except AgentError as exc:
        log.warning("[timeslice] job=%s the agent's figures are unknown: %s", h.job, exc)
        return {}


def pick_swap(h: Handoff, reports: list[dict[str, Any]] | None, agent: dict[str, Any]) -> SwapMode:
    """``swap=auto``: what every GPU and host of the ranks can afford (:func:`~timeslice_verl.handoff.swap_choice.choose`)."""
    assert h.ranks is not None
    swap, why = swap_choice.choose(reports if can_park(h.ranks) else None, agent)
    log.log(logging.INFO if swap is not SwapMode.checkpoint else logging.WARNING, "[timeslice] job=%s swap=auto: %s (%s)",
            h.job, swap, why)
    return swap


__all__ = ["begin"]
