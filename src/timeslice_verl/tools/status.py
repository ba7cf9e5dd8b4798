"""Human rendering of the agent's status (``timeslice-verl status``)."""

from __future__ import annotations

from typing import Any


def _gib(n: float | int | None) -> str:
    return f"{(n or 0) / 2**30:.2f} GiB"


def render_status(status: dict[str, Any]) -> str:
    agent = status.get("agent", {})
    lines = [
        f"agent {agent.get('agent_version', '?')} (pid {agent.get('pid', '?')}) on {agent.get('socket', '?')}",
        f"backend: {agent.get('backend', '?')} — {agent.get('backend_description', '')}; GPUs {agent.get('gpus', [])}",
        f"GPU owner: {status.get('owner', '?')}" + (f"   (now: {status['transition']})" if status.get("transition") else "")
        + (f"\n  waiting for the tenant: {status['waiting_for']}" if status.get("waiting_for") else ""),
    ]
    gpu = status.get("gpu")
    if gpu:
        lines.append(f"GPU memory: {_gib(gpu['used'])} used of {_gib(gpu['total'])}, {_gib(gpu['free'])} free (driver {gpu.get('driver')})")
    tenant = status.get("tenant")
    if tenant:
        line = f"tenant: vLLM {tenant.get('version') or '?'} at {tenant['url']}: {tenant['state']}"
        lines.append(line + (f" — {tenant['error']}" if tenant.get("error") else ""))
    else:
        lines.append("tenant: none registered")
    jobs = status.get("jobs", [])
    if jobs:
        header = f"{'JOB':20} {'STATE':13} {'HOLDS':5} {'PIDS':18} {'FROZEN':>11} {'FREEZE':>8} {'THAW':>8}  NOTE"
        lines += ["jobs:", "  " + header]
        for j in jobs:
            pids = ",".join(map(str, j.get("pids", []))) or "-"
            note = j.get("fault") or ("queued" if j.get("queued") else "prepared" if j.get("prepared") else "")
            if not j.get("attached"):
                note = (note + " " if note else "") + "(no client)"
            lines.append(
                f"  {j['name']:20} {j['state']:13} {'yes' if j.get('holding') else 'no':5} {pids:18} "
                f"{_gib(j.get('frozen_bytes')):>11} {j.get('last_freeze_s', 0):7.2f}s {j.get('last_thaw_s', 0):7.2f}s  {note}"
            )
    else:
        lines.append("jobs: none")
    lines.append(f"queue: {', '.join(status.get('queue', [])) or '-'}")
    return "\n".join(lines)
