"""The agent's settings as two values, built once from the config by the daemon (``server.py``) and handed to the
parts that need them: how the agent treats its jobs, and how it treats its tenant (kept in the tenant's room,
:mod:`timeslice_verl.agent.tenant.options`)."""

from __future__ import annotations

from dataclasses import dataclass

from timeslice_verl.agent.tenant.options import TenantOptions

MAX_PREPARE_TTL_S = 60.0
"""The longest a ``prepare`` keeps the tenant asleep for a job that has not asked yet (a longer ``ttl_s`` is cut)."""


@dataclass(frozen=True)
class AgentOptions:
    prepare_ttl_s: float = MAX_PREPARE_TTL_S
    watch_interval_s: float = 0.2
    """How often the watchdog looks (exited processes, expired prepares, a tenant's memory)."""
    reattach_grace_s: float = 60.0
    park_overhead_bytes: int = 3 * 2**30
    shutdown_timeout_s: float = 10.0


__all__ = ["AgentOptions", "MAX_PREPARE_TTL_S", "TenantOptions"]
