"""Prometheus endpoint of the agent (``timeslice.agent.metrics_port``), via prometheus-client.

Counts and times every transition (freeze, thaw, tenant yield/reclaim) with the bytes it moved,
how long trainers waited for the GPU, and who owns the GPU now. It binds ``metrics_host``
(127.0.0.1 by default) so it is reachable only from the node unless the user says otherwise.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from timeslice_verl.agent.arbiter import Arbiter

_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class AgentMetrics:
    def __init__(self, arbiter: Arbiter, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.transitions = Counter("timeslice_transitions", "GPU transitions performed", ["action", "ok"], registry=r)
        self.transition_seconds = Histogram(
            "timeslice_transition_seconds", "Duration of a transition", ["action"], buckets=_BUCKETS, registry=r
        )
        self.transition_bytes = Counter("timeslice_transition_bytes", "GPU bytes moved by transitions", ["action"], registry=r)
        self.acquire_wait = Histogram(
            "timeslice_acquire_wait_seconds", "How long a trainer job waited for the GPU", ["job"], buckets=_BUCKETS, registry=r
        )
        self.ladder = Counter("timeslice_tenant_ladder", "Tenant yields that went past the polite step, by the step "
                              "they ended on (abort, kill)", ["step"], registry=r)
        self.owner = Gauge("timeslice_gpu_owner", "1 for the current owner of the GPU", ["owner"], registry=r)
        self.wedged = Counter("timeslice_tenant_wedged", "Times a tenant server stopped answering the agent's probe while "
                              "it had the GPU", registry=r)
        self._arbiter = arbiter
        self._owners: set[str] = set()
        arbiter.journal.listeners.append(self.observe)
        self._update_owner()

    def observe(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "transition":
            action = data["action"]
            self.transitions.labels(action=action, ok=str(bool(data["ok"])).lower()).inc()
            self.transition_seconds.labels(action=action).observe(max(0.0, data["end"] - data["start"]))
            phases = data.get("phases") or {}
            moving = phases.get("checkpoint" if action == "freeze" else "restore", 1.0)
            if data.get("bytes") and moving > 0:  # a lock after a park moves nothing: its bytes stayed on the GPU
                self.transition_bytes.labels(action=action).inc(data["bytes"])
        elif kind == "ladder":
            self.ladder.labels(step=data["step"]).inc()
        elif kind == "wedged":
            self.wedged.inc()
        elif kind == "acquire":
            self.acquire_wait.labels(job=data["job"]).observe(data["waited_s"])
        self._update_owner()

    def _update_owner(self) -> None:
        current = self._arbiter.owner().split(":")[0] if self._arbiter.owner().startswith("job:") else self._arbiter.owner()
        current = "trainer" if current == "job" else current
        for name in self._owners | {current}:
            self.owner.labels(owner=name).set(1 if name == current else 0)
        self._owners.add(current)


class Exporter:
    def __init__(self, metrics: AgentMetrics, server: Any, thread: Any) -> None:
        self.metrics = metrics
        self._server, self._thread = server, thread

    def close(self) -> None:
        self._server.shutdown()


def start_exporter(arbiter: Arbiter, host: str, port: int) -> Exporter:
    metrics = AgentMetrics(arbiter)
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return Exporter(metrics, server, thread)
