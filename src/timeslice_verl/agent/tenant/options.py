"""How the agent treats its tenant: one value, built from ``timeslice.tenant`` by the daemon and handed down to
:class:`~timeslice_verl.agent.tenant.tenancy.Tenancy` (it lives in the tenant's room, so that room imports nothing
above it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from timeslice_verl.agent.tenant.hold import HoldPolicy


@dataclass(frozen=True)
class TenantOptions:
    request_timeout_s: float = 30.0
    drain_timeout_s: float = 600.0
    pause_mode: str = "keep"
    reclaim_deadline_s: float = 10.0
    pause_grant_s: float = 0.05
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.75
    warm_up: bool = True
    hold: HoldPolicy = field(default_factory=HoldPolicy)


__all__ = ["TenantOptions"]
