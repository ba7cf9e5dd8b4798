"""Human rendering of the agent's status and the node's batch service (``timeslice-verl status``).

Every string that came from elsewhere (a tenant's error, a supervisor's exit note, a job's fault) is shown with its
control characters escaped: a status must never move the terminal's cursor or change its colours."""

from __future__ import annotations

from typing import Any


def clean(value: Any) -> str:
    """``value`` as text a terminal shows as is: control characters (escape sequences, CR, BEL…) escaped."""
    text = str(value)
    if all(ch.isprintable() for ch in text):
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


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
    lines += _tenant_lines(status.get("tenant"), status.get("ladder") or {})
    by = status.get("yield_by")
    if by and status.get("tenant"):
        how = "held awake (paused)" if by.get("held") else "a pause alone" if by.get("pause_only") else "pause and sleep"
        lines.append(f"  yields by ({clean(by.get('setting', '?'))}): {how} — {clean(by.get('why', ''))}")
    jobs = status.get("jobs", [])
    if jobs:
        header = f"{'JOB':20} {'STATE':13} {'HOLDS':5} {'PIDS':18} {'FROZEN':>11} {'FREEZE':>8} {'THAW':>8}  NOTE"
        lines += ["jobs:", "  " + header]
        for j in jobs:
            pids = ",".join(map(str, j.get("pids", []))) or "-"
            note = clean(j.get("fault") or ("queued" if j.get("queued") else "prepared" if j.get("prepared") else ""))
            if not j.get("attached"):
                note = (note + " " if note else "") + "(no client)"
            lines.append(
                f"  {clean(j['name']):20} {j['state']:13} {'yes' if j.get('holding') else 'no':5} {pids:18} "
                f"{_gib(j.get('frozen_bytes')):>11} {j.get('last_freeze_s', 0):7.2f}s {j.get('last_thaw_s', 0):7.2f}s  {note}"
            )
    else:
        lines.append("jobs: none")
    lines.append(f"queue: {', '.join(status.get('queue', [])) or '-'}")
    return "\n".join(lines)


def _tenant_lines(tenant: dict[str, Any] | None, ladder: dict[str, Any]) -> list[str]:
    if not tenant:
        return ["tenant: none registered"]
    line = f"tenant: vLLM {clean(tenant.get('version') or '?')} at {clean(', '.join(tenant['urls']))}: {tenant['state']}"
    lines = [line + (f" — {clean(tenant['error'])}" if tenant.get("error") else "")]
    if tenant.get("wedged"):
        lines.append(f"  WEDGED (no answer while it had the GPU): {clean(', '.join(tenant['wedged']))}: a reclaim kills it")
    steps = {k: v for k, v in ladder.items() if k in ("abort", "kill") and v}
    if steps:
        lines.append(f"  reclaim ladder: {', '.join(f'{k} {v}x' for k, v in steps.items())}"
                     + (f"; last: {clean(ladder['last'])}" if ladder.get("last") else ""))
    sup = tenant.get("supervisor")
    if sup:
        restart = f" (back in {sup['restart_s']:.1f} s)" if sup.get("restart_s") is not None else ""
        lines.append(f"  supervisor: server pid {sup.get('pid', '?')}, {sup.get('restarts', 0)} restart(s)"
                     + (f"; last: {clean(sup['last_exit'])}{restart}" if sup.get("last_exit") else ""))
    return lines


def render_batch(summary: dict[str, Any]) -> str:
    """The node's batch service (its ``/timeslice/summary``): lines by state, the open batches' progress and ETAs."""
    from timeslice_verl.batch.client import eta_words

    if summary.get("error"):
        return f"batch service: {clean(summary['error'])}"
    lines, gate = summary.get("lines") or {}, summary.get("gate") or {}
    rate = summary.get("tokens_per_s_open")
    out = [f"batch service: feeding {clean(summary.get('tenant', '?'))} — "
           f"{'sending' if gate.get('open') else 'holding'} (following the {gate.get('source', '?')}"
           + (f": {clean(gate['why'])}" if gate.get("why") and not gate.get("open") else "") + "); "
           f"lines queued {lines.get('queued', 0)}, claimed by a feeder {lines.get('inflight', 0)}, "
           f"completed {lines.get('done', 0)}, "
           f"retried {lines.get('retried', 0)}, failed {lines.get('failed', 0)}"
           + (f"; {rate:.0f} tokens/s while the tenant had the GPU" if rate else "")]
    speed = summary.get("speed")
    if speed:
        out.append(f"  measured over the last {speed['window_s']:.0f} s: {speed['tokens_per_open_s']:.0f} tokens/s "
                   f"while sending, the gate open {speed['open_share'] * 100:.0f} % of the time (the batches' ETAs "
                   "rest on it)")
    for t in summary.get("tenants") or []:
        out.append(f"  to {clean(t.get('tenant', '?'))}: {t.get('inflight', 0)} requests open at the tenant, of a limit of {t.get('limit', 0)} "
                   f"(it follows vLLM); {t.get('sent', 0)} sent, {t.get('answered', 0)} answered"
                   + (f", {t['shed']} shed when the limit fell" if t.get("shed") else "")
                   + (f"; {t['resumed']} continued where a yield cut them ({t.get('kept', 0)} tokens kept)"
                      if t.get("resumed") else ""))
    valley = summary.get("valley") or {}
    if valley.get("lent_s"):
        out.append(f"  valleys: {valley['lent_s']:.0f} s lent, {valley.get('used_s', 0):.0f} s used, "
                   f"{valley.get('wasted_s', 0):.0f} s wasted (the gate open, nothing to send)")
    for o in summary.get("owners") or []:
        out.append(f"  owner {clean(o['owner'])}: {o['input_tokens']} tokens in, {o['output_tokens']} out, "
                   f"{o['gpu_seconds']:.1f} GPU-s ({o['gpu_seconds_last_day']:.1f} in the last day), "
                   f"{o['cut_tries']} tries cut by a yield")
    if summary.get("key_file"):
        out.append(f"  API key: {clean(summary['key_file'])} (timeslice-verl batch key prints it)")
    for b in summary.get("open_batches") or []:
        done = b.get("completed", 0) + b.get("failed", 0)
        what = f"  validation of version {b['validation_version']}" if b.get("validation_version") is not None else ""
        eta = eta_words(b.get("timeslice_eta"))
        out.append(f"  {clean(b['id'])}  {b['status']:11} {done}/{b['total']} ({done / max(1, b['total']) * 100:.0f} %), "
                   f"{b.get('failed', 0)} failed{what}{', ' + eta if eta else ''}")
    return "\n".join(out)
