"""``timeslice-verl batch serve``: the batch service of one node, on ``timeslice.batch.host:port`` (127.0.0.1 by
default), its state in ``timeslice.batch.db``, feeding ``timeslice.batch.tenant_urls`` (default: every tenant of the agent's, one
feeder each, from the same queue).

uvicorn serves the app and owns SIGTERM/SIGINT (a graceful stop); the feeder runs beside it for the app's lifetime.
Lines the service had in flight when it was killed are sent again when it starts (the store's ``recover``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from timeslice_verl.batch.auth import RequireKey, service_key
from timeslice_verl.batch.concurrency import Policy
from timeslice_verl.batch.feeder import Feeder
from timeslice_verl.batch.files import Files
from timeslice_verl.batch.gate import Gate
from timeslice_verl.batch.store import OPEN, Store
from timeslice_verl.config.schema import TimesliceSettings, socket_path
from timeslice_verl.log import get_logger

log = get_logger("batch")

MODELS_TTL_S = 60.0


def default_db() -> Path:
    """Where the service keeps its state when ``timeslice.batch.db`` is empty (it must outlive a reboot)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "timeslice-verl" / "batch.sqlite"


def db_path(settings: TimesliceSettings) -> Path:
    return Path(settings.batch.db).expanduser() if settings.batch.db else default_db()


def tenant_urls(settings: TimesliceSettings) -> list[str]:
    """Every tenant of the node the service feeds: ``batch.tenant_urls``, else the agent's (``tenant.urls``: one vLLM
    per GPU of a multi-GPU trainer, each fed from the same queue)."""
    urls = list(settings.batch.tenant_urls or settings.tenant.urls)
    if not urls:
        raise ValueError("timeslice.batch.tenant_urls: no tenant to feed (set it, or timeslice.tenant.urls)")
    return urls


class Models:
    """What the tenant serves (``/v1/models``), fetched when a batch is created and kept a minute; None: unknown."""

    def __init__(self, url: str) -> None:
        self.url, self._seen, self._at = url, None, 0.0

    def __call__(self) -> set[str] | None:
        if self._seen is not None and time.monotonic() - self._at < MODELS_TTL_S:
            return self._seen
        try:
            data = httpx.get(f"{self.url}/v1/models", timeout=2).json().get("data") or []
            self._seen, self._at = {m["id"] for m in data if isinstance(m, dict) and "id" in m}, time.monotonic()
        except (httpx.HTTPError, ValueError, AttributeError, TypeError):
            return self._seen  # the tenant is asleep or restarting: what it served last, or unknown
        return self._seen


class Service:
    """The store, the gate, the feeder and the app of one node's batch service."""

    def __init__(self, settings: TimesliceSettings) -> None:
        from timeslice_verl.batch.app import make_app
        from timeslice_verl.batch.metrics import BatchMetrics

        b = settings.batch
        self.settings, self.urls = settings, tenant_urls(settings)
        self.url = self.urls[0]
        self.store = Store(db_path(settings))
        sock = str(socket_path(settings)) if b.follow_agent else None
        policy = Policy(start=min(b.concurrency, b.max_concurrency), ceiling=b.max_concurrency)
        self.gates = [Gate(sock, poll_s=b.poll_s) for _ in self.urls]
        """One per tenant: the agent's word for all, each tenant's own health (a restarting server stops only its
        own lines)."""
        self.feeders = [Feeder(self.store, url, gate, policy=policy, adapt=b.adapt_concurrency, max_attempts=b.max_attempts,
                               request_timeout_s=b.request_timeout_s, settle=i == 0)
                        for i, (url, gate) in enumerate(zip(self.urls, self.gates))]
        self.gate, self.feeder = self.gates[0], self.feeders[0]
        self.metrics = BatchMetrics(self)
        self.app = make_app(self.store, models=Models(self.url), kick=self.kick, summary=self.summary,
                            metrics=self.metrics.render, max_file_bytes=int(b.max_file_mb * 2**20),
                            chunk_bytes=max(1, int(b.chunk_mb * 2**20)),
                            problem=lambda: "; ".join(f.problem for f in self.feeders if f.problem))
        self.app.router.lifespan_context = self._lifespan
        key, self.key_source = service_key(b.key_file)
        self.asgi = RequireKey(self.app, key)
        """What uvicorn serves: the app behind its key."""

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        swept = await asyncio.to_thread(Files(self.store).sweep)
        if swept:
            log.warning("batch: dropped %d chunk(s) of uploads that did not finish", swept)
        recovered = await asyncio.to_thread(self.store.recover)  # once, before any feeder claims
        if recovered:
            log.warning("batch: %d line(s) were in flight when the service stopped: queued again", recovered)
        tasks = [asyncio.create_task(f.run(), name=f"batch-feeder-{i}") for i, f in enumerate(self.feeders)]
        log.info("batch: feeding %s (gate: %s), state in %s, key in %s", ", ".join(self.urls), self.gate.source,
                 self.store.path, self.key_source)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for gate in self.gates:
                gate.close()
            self.store.close()

    def kick(self) -> None:
        for feeder in self.feeders:
            feeder.kick()

    def seconds_open(self) -> float:
        """Tenant-GPU seconds: each tenant's time with its GPU, summed."""
        return sum(g.seconds_open() for g in self.gates)

    def summary(self) -> dict[str, Any]:
        """What ``timeslice-verl status`` shows: the lines over every batch, the open batches, the tenant's share."""
        totals = self.store.totals()
        open_s = self.seconds_open()
        batches = [{"id": r["id"], "status": r["status"], "total": r["total"], **self.store.counts(r["id"])}
                   for r in self.store.batches(limit=10) if r["status"] in OPEN]
        each = [{"tenant": f.url, "open": g.open, "open_s": round(g.seconds_open(), 3), **_stats(f)}
                for f, g in zip(self.feeders, self.gates)]
        feeder = {k: sum(e[k] for e in each) for k in ("limit", "inflight", "sent", "answered", "written", "writes")}
        feeder.update(healthy=all(f.healthy for f in self.feeders), samples=self.feeder.stats.samples[-50:],
                      problem="; ".join(f.problem for f in self.feeders if f.problem))
        return {"tenant": self.url, "tenants": each,
                "gate": {"open": any(g.open for g in self.gates), "source": self.gate.source, "open_s": round(open_s, 3)},
                "feeder": feeder, "lines": totals, "open_batches": batches,
                "tokens_per_s_open": round(totals["tokens"] / open_s, 3) if open_s > 0 else None}


def _stats(feeder: Feeder) -> dict[str, Any]:
    st = feeder.stats
    return {"limit": st.limit, "inflight": st.inflight, "sent": st.sent, "answered": st.answered, "written": st.written,
            "writes": st.writes}


def serve(settings: TimesliceSettings) -> None:
    """Run the service until SIGTERM/SIGINT."""
    import uvicorn

    service = Service(settings)
    uvicorn.run(service.asgi, host=settings.batch.host, port=settings.batch.port, log_level="warning",
                timeout_graceful_shutdown=10)


__all__ = ["Service", "db_path", "default_db", "serve", "tenant_urls"]
