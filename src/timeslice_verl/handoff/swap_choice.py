"""``timeslice.handoff.swap=auto``: the cheapest swap each node can afford, and what a round trip should cost. Pure.

* ``resident`` moves nothing: the trainer's tensors stay on the GPU beside the awake tenant, so the way back is the
  tenant's yield alone. It fits where every rank's footprint once its caches are freed (NVML, the rank's own
  process), plus what the job's other processes hold on that GPU (``device_others``: verl's rollouter and its
  vLLM where they share the trainer's GPU; the agent never freezes them), plus the tenant's awake footprint on
  that GPU (what the agent measured), plus a margin, is within the GPU's memory.
* ``park`` copies the ranks' tensors to pinned host RAM at copy-engine speed (tens of GB/s) but pins as much host
  RAM as they hold on the GPU, for the whole run: it is chosen where every host has that, with a quarter and
  4 GiB to spare (the kernel's ``MemAvailable``, read on each rank's host), and, where other processes of the job
  share a rank's GPU, the awake tenant fits beside them and what the parked rank keeps there (its context).
* ``checkpoint`` needs neither: the CUDA driver moves each process whole (a few GB/s). Where even that leaves the
  tenant no room beside the job's other processes, the reason says so: lending that GPU wakes nothing.

:func:`round_trip_estimate` says what a handoff of the chosen mode should take before any was measured (bytes to
move over this node's bandwidth, plus the tenant's yield and wake), so the first valleys are lent only when they
pay.
"""

from __future__ import annotations

from typing import Any

from timeslice_verl.names import SwapMode

SPARE_FRACTION = 0.25
SPARE_BYTES = 4 * 2**30
RESIDENT_MARGIN_FRACTION = 0.05
"""What ``resident`` keeps free on a GPU beyond the trainer's and the tenant's footprints (at least 2 GiB)."""
RESIDENT_MARGIN_BYTES = 2 * 2**30
PINNED_GBPS = 20.0
"""Pinned host↔device copies when a rank did not measure its own: low on purpose (a current GPU does more)."""
CHECKPOINT_GBPS, RESTORE_GBPS = 1.5, 4.0
"""The CUDA driver's checkpoint and restore when the agent has moved nothing yet: a little below what a current
GPU does."""
TENANT_S = 2.0
"""The tenant's yield plus wake before the agent has timed one (vLLM's first sleep pins its host backup: ~1.6 s)."""


def parkable(available: int) -> int:
    """The most trainer state (bytes) a host with ``available`` bytes lets ``auto`` park."""
    return max(0, int((available - SPARE_BYTES) / (1 + SPARE_FRACTION)))


def resident_room(gpu_total: int, tenant_bytes: int) -> int:
    """The most a rank may keep on a GPU of ``gpu_total`` beside a tenant of ``tenant_bytes`` for ``resident``."""
    return max(0, gpu_total - tenant_bytes - max(RESIDENT_MARGIN_BYTES, int(gpu_total * RESIDENT_MARGIN_FRACTION)))


def agent_figures(status: dict[str, Any]) -> dict[str, Any]:
    """What the choice needs from the agent's ``status`` (one node's, or across nodes the first that has them):
    the tenant's awake footprint per GPU, its last yield and wake, the driver's bandwidth."""
    if "nodes" in status:
        for node in (status.get("nodes") or {}).values():
            found = agent_figures(node)
            if found:
                return found
        return {}
    tenant = status.get("tenant") or {}
    gpus = max(1, len((status.get("agent") or {}).get("gpus") or [0]))
    out: dict[str, Any] = {}
    if tenant.get("footprint"):
        out["tenant_bytes"] = int(tenant["footprint"]) // gpus
    for key in ("yield_s", "reclaim_s"):
        if tenant.get(key):
            out[key] = float(tenant[key])
    for key in ("checkpoint_gbps", "restore_gbps"):
        if (status.get("bandwidth") or {}).get(key):
            out[key] = float(status["bandwidth"][key])
    return out


def choose(reports: list[dict[str, Any]] | None, agent: dict[str, Any] | None = None) -> tuple[SwapMode, str]:
    """(swap, why) from one ``release_caches`` report per rank (``host``, ``live_after``, ``device_used``,
    ``device_others``, ``device_total``, ``host_available``) and the agent's figures; ``reports`` None: the ranks
    cannot move their own tensors."""
    if reports is None:
        return SwapMode.checkpoint, "the ranks cannot park"
    if not reports:
        return SwapMode.checkpoint, "no rank reported its memory"
    if not any(int(r.get("live_after", 0)) for r in reports):
        return SwapMode.checkpoint, "the ranks hold no GPU memory (no CUDA here?)"
    agent = agent or {}
    resident, why = _resident_fits(reports, agent)
    if resident:
        return SwapMode.resident, why
    park, why_park = _park_fits(reports)
    if park:
        park, why_park = _parked_room(reports, agent, why_park)
    if park:
        return SwapMode.park, f"{why}; {why_park}"
    force = "" if why_park.startswith("park leaves") else "; set timeslice.handoff.swap=park to force it"
    return SwapMode.checkpoint, f"{why}; {why_park}{force}{_no_room_at_all(reports, agent)}"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _others(r: dict[str, Any]) -> str:
    others = int(r.get("device_others", 0))
    return f" (+ {_gib(others)} of the job's other processes, which stay)" if others else ""


def _resident_fits(reports: list[dict[str, Any]], agent: dict[str, Any]) -> tuple[bool, str]:
    tenant = int(agent.get("tenant_bytes", 0))
    if not tenant:
        return False, "resident: the tenant's footprint is not known (the agent has not measured it)"
    short, fits = [], []
    for r in reports:
        used, total = int(r.get("device_used", 0)), int(r.get("device_total", 0))
        if not used or not total:
            return False, f"resident: pid {r.get('pid')} did not report its GPU footprint (no NVML?)"
        room = resident_room(total, tenant)
        stays = used + int(r.get("device_others", 0))
        (fits if stays <= room else short).append(f"pid {r.get('pid')} keeps {_gib(used)}{_others(r)}, room "
                                                  f"{_gib(room)} beside a {_gib(tenant)} tenant")
    if short:
        return False, "resident does not fit: " + "; ".join(short)
    return True, "resident fits: " + "; ".join(fits)


def _parked_room(reports: list[dict[str, Any]], agent: dict[str, Any], why_park: str) -> tuple[bool, str]:
    """Where the job's other processes share a rank's GPU: the awake tenant must fit beside them and what the parked
    rank keeps there (its footprint less its tensors), or a park frees the GPU for a tenant that cannot wake."""
    tenant = int(agent.get("tenant_bytes", 0))
    short = []
    for r in reports:
        others, total = int(r.get("device_others", 0)), int(r.get("device_total", 0))
        if not tenant or not others or not total:
            continue
        kept = max(0, int(r.get("device_used", 0)) - int(r.get("live_after", 0)))
        room = resident_room(total, tenant)
        if kept + others > room:
            short.append(f"pid {r.get('pid')} keeps {_gib(kept)} parked{_others(r)}, room {_gib(room)} beside a "
                         f"{_gib(tenant)} tenant")
    if short:
        return False, "park leaves the tenant no room: " + "; ".join(short)
    return True, why_park


def _no_room_at_all(reports: list[dict[str, Any]], agent: dict[str, Any]) -> str:
    """A warning where the job's other processes alone leave the awake tenant no room on a rank's GPU."""
    tenant = int(agent.get("tenant_bytes", 0))
    full = [f"pid {r.get('pid')}'s GPU: {_gib(int(r.get('device_others', 0)))} of the job's other processes, room "
            f"{_gib(resident_room(int(r.get('device_total', 0)), tenant))} beside a {_gib(tenant)} tenant"
            for r in reports if tenant and int(r.get("device_total", 0))
            and int(r.get("device_others", 0)) > resident_room(int(r.get("device_total", 0)), tenant)]
    return ("; even a checkpoint leaves the tenant no room (" + "; ".join(full) + "): lower the rollout's "
            "gpu_memory_utilization or the tenant's") if full else ""


def _park_fits(reports: list[dict[str, Any]]) -> tuple[bool, str]:
    need: dict[str, int] = {}
    room: dict[str, int] = {}
    for r in reports:
        host = str(r.get("host", "?"))
        need[host] = need.get(host, 0) + int(r.get("live_after", 0))
        room[host] = int(r.get("host_available", 0))
    short = [f"{h} needs {need[h] / 2**30:.1f} GiB pinned, {room[h] / 2**30:.1f} GiB available" for h in sorted(need)
             if need[h] * (1 + SPARE_FRACTION) + SPARE_BYTES > room[h]]
    if short:
        return False, "park would pin host RAM the node cannot spare: " + "; ".join(short)
    return True, "park: " + "; ".join(f"{h} pins {need[h] / 2**30:.1f} GiB of {room[h] / 2**30:.1f} GiB available"
                                      for h in sorted(need))


def round_trip_estimate(swap: SwapMode, reports: list[dict[str, Any]] | None, pinned: list[dict[str, Any]],
                        agent: dict[str, Any]) -> tuple[float, str]:
    """(seconds, how) a handoff of ``swap`` should take, out and back, before any was measured: the tenant's yield
    and wake, plus the bytes to move over this node's bandwidth (the slowest rank's)."""
    tenant = float(agent.get("yield_s", 0.0)) + float(agent.get("reclaim_s", 0.0)) or TENANT_S
    how = f"tenant {tenant:.2f} s" + ("" if agent.get("yield_s") else " (not timed yet)")
    reports = reports or []
    if swap.parks:
        moved = max((int(r.get("pinned", 0)) for r in pinned), default=0)
        gbps = min((float(r.get("copy_gbps", 0)) or PINNED_GBPS for r in pinned), default=PINNED_GBPS)
        seconds = 2 * moved / 1e9 / gbps
        how += f" + park and unpark of {moved / 2**30:.1f} GiB at {gbps:.0f} GB/s"
        if swap is SwapMode.park_checkpoint:
            rest = max((int(r.get("device_used", 0)) - int(r.get("live_after", 0)) for r in reports), default=0)
            seconds += _driver_s(rest, agent)
            how += f" + the driver's round trip of the {rest / 2**30:.1f} GiB left"
        return tenant + seconds, how
    if swap is SwapMode.checkpoint:
        moved = max((int(r.get("device_used", 0)) or int(r.get("reserved_after", 0)) for r in reports), default=0)
        return tenant + _driver_s(moved, agent), how + f" + the driver's round trip of {moved / 2**30:.1f} GiB"
    return tenant, how + " (resident: nothing moves)"


def _driver_s(nbytes: int, agent: dict[str, Any]) -> float:
    out = float(agent.get("checkpoint_gbps", 0)) or CHECKPOINT_GBPS
    back = float(agent.get("restore_gbps", 0)) or RESTORE_GBPS
    return nbytes / 1e9 / out + nbytes / 1e9 / back


__all__ = ["SPARE_BYTES", "SPARE_FRACTION", "agent_figures", "choose", "parkable", "resident_room", "round_trip_estimate"]
