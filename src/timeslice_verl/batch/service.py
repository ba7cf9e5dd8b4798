"""``timeslice-verl batch serve``: the batch service of one node, on ``timeslice.batch.host:port`` (127.0.0.1 by
default), its state in ``timeslice.batch.db``, feeding ``timeslice.batch.tenant_urls`` (default: every tenant of the agent's, one
feeder each, from the same queue).

uvicorn serves the app and owns SIGTERM/SIGINT (a graceful stop); the feeder runs beside it for the app's lifetime.
Lines the service had in flight when it was killed are sent again when it starts (the store's ``recover``).
"""

from __future__ import annotations

import asyncio
import json
import enum
import contextlib
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from timeslice_verl.batch.auth import KeyRing, RequireKey
from timeslice_verl.batch.concurrency import Policy
from timeslice_verl.batch.estimates import ETA_FIELD, Estimates
from timeslice_verl.batch.eta import Meter, Rate, Sample
from timeslice_verl.batch.feeder import Feeder
from timeslice_verl.batch.files import Files
from timeslice_verl.batch.gate import Gate
from timeslice_verl.batch.store import CREATING_S, OPEN, Store, StoreUnavailable
from timeslice_verl.batch.usage import node_figures, owners
from timeslice_verl.config.schema import TimesliceSettings, socket_path
from timeslice_verl.names import VALIDATION_VERSION, TenantRole
from timeslice_verl.log import get_logger

log = get_logger("batch")

MODELS_TTL_S = 60.0
SAMPLE_S = 2.0
"""How often the service samples its counters for the speed the ETAs rest on (valleys last seconds and more)."""


def default_db() -> Path:
    """Where the service keeps its state when ``timeslice.batch.db`` is empty (it must outlive a reboot)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "timeslice-verl" / "batch.sqlite"


def db_path(settings: TimesliceSettings) -> Path:
    return Path(settings.batch.db).expanduser() if settings.batch.db else default_db()


class Role(str, enum.Enum):
    """What one process of the service does: ``all`` (one node: the API and a feeder per tenant), ``api`` (the API
    alone: a replica of a cluster's), ``feed`` (a node's feeders alone, beside its tenants)."""

    all = "all"
    api = "api"
    feed = "feed"

    @property
    def feeds(self) -> bool:
        return self is not Role.api


def open_store(settings: TimesliceSettings) -> Store:
    """The queue the settings name: the node's SQLite file, or the cluster's PostgreSQL (its DSN never a setting)."""
    if str(settings.batch.store) == "postgresql":
        from timeslice_verl.batch.pg import open_postgresql

        return Store(open_postgresql(settings.batch.dsn_file, settings.batch.postgresql))
    return Store(db_path(settings))


def tenant_urls(settings: TimesliceSettings) -> list[str]:
    """Every tenant of the node the service feeds users' lines: ``batch.tenant_urls``, else the agent's (``tenant.urls``:
    one vLLM per GPU of a multi-GPU trainer, each fed from the same queue) but the policy tenant, which the agent
    yields and reclaims with the others and which answers validation runs alone."""
    policy = settings.validate.policy_url.rstrip("/")
    urls = [u for u in (settings.batch.tenant_urls or settings.tenant.urls) if u.rstrip("/") != policy]  # its own feeder
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

    def __init__(self, settings: TimesliceSettings, role: Role = Role.all) -> None:
        from timeslice_verl.batch.app import make_app
        from timeslice_verl.batch.metrics import BatchMetrics

        b = settings.batch
        self.role = role
        self.urls = tenant_urls(settings) if role.feeds else list(b.tenant_urls or settings.tenant.urls)
        self.settings, self.url = settings, (self.urls or [""])[0]
        self.store = open_store(settings)
        self.keys = KeyRing.of(b.key_file)
        """The keys and their owners' policies, followed as the key file changes (on every process that reads it)."""
        self.store.queue.quotas.policy_of = self.keys.policy
        sock = str(socket_path(settings)) if b.follow_agent else None
        policy = Policy(start=min(b.concurrency, b.max_concurrency), ceiling=b.max_concurrency)
        self.policy_url = settings.validate.policy_url.rstrip("/")
        """The policy tenant: fed the validation runs alone, by a feeder of its own."""
        fed = [(u, TenantRole.batch) for u in self.urls] + ([(self.policy_url, TenantRole.policy)] if self.policy_url else [])
        self.gates = [Gate(sock, poll_s=b.poll_s) for _ in fed] if role.feeds else []
        """One per tenant: the agent's word for all, each tenant's own health (a restarting server stops only its
        own lines)."""
        self.feeders = [Feeder(self.store, url, gate, policy=policy, adapt=b.adapt_concurrency, max_attempts=b.max_attempts,
                               request_timeout_s=b.request_timeout_s, settle=i == 0, lease_s=b.lease_s, role=which,
                               spread=b.spread, resume_partial=b.resume_partial)
                        for i, ((url, which), gate) in enumerate(zip(fed, self.gates))]
        self.meter = Meter()
        """This node's speed while its gate is open and its valley share, recent (:mod:`~timeslice_verl.batch.eta`)."""
        self.etas = Estimates(self.store, self.rate, lambda owner: self.keys.policy(owner).weight)
        self.metrics = BatchMetrics(self)
        served = {TenantRole.batch: Models(self.url) if self.url else None,
                  TenantRole.policy: Models(self.policy_url) if self.policy_url else None}
        self.app = make_app(self.store, models=lambda which: served[which]() if served[which] else None, kick=self.kick,
                            summary=self.summary, api=role is not Role.feed, rate=self.rate,
                            metrics=self.metrics.render, max_file_bytes=int(b.max_file_mb * 2**20),
                            chunk_bytes=max(1, int(b.chunk_mb * 2**20)),
                            problem=lambda: "; ".join(p for p in (*(f.problem for f in self.feeders), self.keys.problem)
                                                      if p))
        self.app.router.lifespan_context = self._lifespan
        self.key_source = self.keys.source
        self.asgi = RequireKey(self.app, self.keys)
        """What uvicorn serves: the app behind its key."""

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        shared = self.store.dialect.shared
        if self.role is not Role.feed:
            swept = await asyncio.to_thread(Files(self.store).sweep, CREATING_S if shared else 0.0)
            if swept:
                log.warning("batch: dropped %d chunk(s) of uploads that did not finish", swept)
        if self.role.feeds or shared:  # one node: all it held; a cluster: what no live feeder holds
            recovered = await asyncio.to_thread(self.store.recover, everything=not shared)  # before any claim
            if recovered:
                log.warning("batch: %d line(s) were in flight when their feeder stopped: queued again", recovered)
        tasks = [asyncio.create_task(f.run(), name=f"batch-feeder-{i}") for i, f in enumerate(self.feeders)]
        if self.gates:
            tasks.append(asyncio.create_task(self._sample(), name="batch-eta-sample"))
        if self.role is not Role.feed:
            tasks.append(asyncio.create_task(sweep_uploads(Files(self.store), self.settings.batch.upload_idle_s),
                                             name="batch-upload-sweep"))
        log.info("batch (%s): feeding %s (gate: %s), state in %s, key in %s", self.role.value,
                 (", ".join(self.urls) + (f"; validation runs: {self.policy_url}" if self.policy_url else ""))
                 if self.role.feeds else "nothing (the API alone)",
                 self.gates[0].source if self.gates else "-", self.store.path, self.key_source)
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

    def rate(self) -> Rate | None:
        """The speed this node measured recently (None: too little yet, or an API replica, which feeds nothing)."""
        return self.meter.rate()

    async def _sample(self) -> None:
        """Every :data:`SAMPLE_S`, the counters the speed is measured from: the gate's open seconds (the users'
        tenants', each tenant's share averaged: their speeds add up), the tokens and lines answered, the backlog, the
        tokens the answered lines asked for and generated."""
        gates = [g for g, f in zip(self.gates, self.feeders) if f.role is TenantRole.batch] or self.gates
        while True:
            await asyncio.sleep(SAMPLE_S)
            try:
                t = await asyncio.to_thread(self.store.counters)
            except StoreUnavailable:
                continue
            self.meter.add(Sample(time.monotonic(), sum(g.seconds_open() for g in gates) / len(gates), int(t["tokens"]),
                                  int(t["done"]), int(t["backlog"]), t["asked"], int(t["asked_out"])))

    def seconds_open(self) -> float:
        """Tenant-GPU seconds: each tenant's time with its GPU, summed."""
        return sum(g.seconds_open() for g in self.gates)

    def summary(self) -> dict[str, Any]:
        """What ``timeslice-verl status`` shows: the lines over every batch, the open batches, the tenant's share."""
        totals = self.store.totals()
        open_s = self.seconds_open()
        rows = [r for r in self.store.batches(limit=10) if r["status"] in OPEN]
        etas = self.etas.fields(rows)
        batches = [{"id": r["id"], "status": r["status"], "total": r["total"], "tenant_role": r["tenant_role"],
                    "validation_version": _validation_version(r["metadata"]), **self.store.counts(r["id"]),
                    ETA_FIELD: etas[r["id"]]} for r in rows]
        rate = self.rate()
        each = [{"tenant": f.url, "open": g.open, "open_s": round(g.seconds_open(), 3), **_stats(f)}
                for f, g in zip(self.feeders, self.gates)]
        feeder = {k: sum(e[k] for e in each) for k in ("limit", "inflight", "sent", "answered", "written", "writes", "shed",
                                                        "lost", "resumed", "kept")}
        feeder.update(healthy=all(f.healthy for f in self.feeders), spread=any(f.spread for f in self.feeders),
                      answer_s=each[0]["answer_s"] if each else None,
                      samples=self.feeders[0].stats.samples[-50:] if self.feeders else [],
                      problem="; ".join(f.problem for f in self.feeders if f.problem))
        return {"tenant": self.url, "tenants": each, "role": self.role.value,
                "gate": {"open": any(g.open for g in self.gates), "source": self.gates[0].source if self.gates else "-",
                         "why": "; ".join(dict.fromkeys(g.why for g in self.gates if g.why)), "open_s": round(open_s, 3)},
                "feeder": feeder, "lines": totals, "open_batches": batches, "owners": owners(self.store),
                "valley": node_figures(f.valley for f in self.feeders),
                "tokens_per_s_open": round(totals["tokens"] / open_s, 3) if open_s > 0 else None,
                "speed": None if rate is None else {
                    "basis": str(rate.basis), "tokens_per_open_s": round(rate.tokens_per_open_s, 3),
                    "lines_per_open_s": round(rate.lines_per_open_s, 3), "open_share": round(rate.open_share, 4),
                    "window_s": round(rate.window_s, 1), "fill": None if rate.fill is None else round(rate.fill, 4)}}


async def sweep_uploads(files: Files, idle_s: float) -> None:
    """Drop, while the service runs, the chunks of uploads that stopped (a killed client, a killed replica): those
    not written to for ``idle_s`` (an upload under way, here or on another replica, is written to more often)."""
    while True:
        await asyncio.sleep(max(0.05, idle_s / 4))
        try:
            swept = await asyncio.to_thread(files.sweep, idle_s)
        except StoreUnavailable as exc:
            log.warning("batch: uploads that stopped not swept now: %s", exc)
            continue
        if swept:
            log.warning("batch: dropped %d chunk(s) of uploads that stopped", swept)


def _validation_version(metadata: str | None) -> int | None:
    """The version a validation run validates (its batch's metadata), else None."""
    try:
        value = (json.loads(metadata) if metadata else {}).get(VALIDATION_VERSION)
        return int(value) if value is not None else None
    except (ValueError, TypeError, AttributeError):
        return None


def _stats(feeder: Feeder) -> dict[str, Any]:
    st = feeder.stats
    return {"limit": st.limit, "inflight": st.inflight, "sent": st.sent, "answered": st.answered, "written": st.written,
            "writes": st.writes, "shed": st.shed, "lost": st.lost, "resumed": st.resumed, "kept": st.kept,
            "spread": feeder.spread,
            "answer_s": round(feeder.latency.mean_s, 4) if feeder.latency.mean_s is not None else None}


def serve(settings: TimesliceSettings, role: Role = Role.all) -> None:
    """Run the service (or its API alone, or its feeders alone) until SIGTERM/SIGINT."""
    import uvicorn

    service = Service(settings, role)
    uvicorn.run(service.asgi, host=settings.batch.host, port=settings.batch.port, log_level="warning",
                timeout_graceful_shutdown=10)


__all__ = ["Role", "Service", "db_path", "default_db", "open_store", "serve", "tenant_urls"]
