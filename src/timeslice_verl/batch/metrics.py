"""The batch service's Prometheus metrics, read off the store when scraped: lines queued, in flight, completed,
retried and failed, tokens generated, whether (and how long) the tenant has had the GPU, and the lines a yield cut that
went on from their kept output (labelled by tenant: one a tenant URL the service was given); and who got what from
the valleys (:func:`timeslice_verl.batch.usage.collect`: by configured owner, never by batch)."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from timeslice_verl.batch import usage


class BatchMetrics:
    def __init__(self, service: Any) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        totals = self.service.store.totals()
        for name, key, help_ in (("queued", "queued", "Lines waiting to be sent"),
                                 ("in_flight", "inflight", "Lines sent to the tenant, not answered yet")):
            yield GaugeMetricFamily(f"timeslice_batch_lines_{name}", help_, value=totals[key])
        for name, key, help_ in (("completed", "done", "Lines answered (in an output file)"),
                                 ("failed", "failed", "Lines failed for good (in an error file)"),
                                 ("retried", "retried", "Tries beyond a line's first (pause aborts, kills, restarts)")):
            yield CounterMetricFamily(f"timeslice_batch_lines_{name}", help_, value=totals[key])
        yield CounterMetricFamily("timeslice_batch_tokens", "Completion tokens the tenant generated", value=totals["tokens"])
        limit = GaugeMetricFamily("timeslice_batch_concurrency_limit", "Lines the feeder keeps in flight at most now "
                                  "(follows the tenant's running batch and queue)", labels=["tenant"])
        out = GaugeMetricFamily("timeslice_batch_requests_out", "Requests sent to the tenant and not answered yet",
                                labels=["tenant"])
        has = GaugeMetricFamily("timeslice_batch_tenant_has_gpu", "1 while lines are sent (the tenant owns the GPU)",
                                labels=["tenant"])
        shed = CounterMetricFamily("timeslice_batch_requests_shed", "Requests cancelled because the in-flight limit "
                                   "fell below them (their lines queued again, the try not counted)", labels=["tenant"])
        seconds = CounterMetricFamily("timeslice_batch_tenant_gpu_seconds", "Seconds the tenant has had the GPU",
                                      labels=["tenant"])
        resumed = CounterMetricFamily("timeslice_batch_lines_resumed", "Tries that continued a line from the output "
                                      "a yield's abort left, instead of generating it again", labels=["tenant"])
        kept = CounterMetricFamily("timeslice_batch_tokens_kept", "Tokens aborted answers generated that were kept "
                                   "with their lines (never generated again)", labels=["tenant"])
        for feeder, gate in zip(self.service.feeders, self.service.gates):
            limit.add_metric([feeder.url], feeder.stats.limit)
            out.add_metric([feeder.url], feeder.stats.inflight)
            has.add_metric([feeder.url], 1.0 if gate.open else 0.0)
            shed.add_metric([feeder.url], feeder.stats.shed)
            seconds.add_metric([feeder.url], gate.seconds_open())
            resumed.add_metric([feeder.url], feeder.stats.resumed)
            kept.add_metric([feeder.url], feeder.stats.kept)
        yield from (limit, out, has, shed, seconds, resumed, kept)
        yield from usage.collect(self.service)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["BatchMetrics"]
