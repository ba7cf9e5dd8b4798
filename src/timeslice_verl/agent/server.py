"""The agent daemon: the socket (:mod:`~timeslice_verl.agent.site`), the connection loop
(:mod:`~timeslice_verl.agent.connections`) and the dispatch table (:mod:`~timeslice_verl.agent.dispatch`) in front
of the arbiter, wired from the settings — the only agent module that reads the config.

SIGTERM and SIGINT stop the agent cleanly (no new requests, frozen jobs thawed, vLLM woken; a second one exits at
once); SIGHUP is ignored. The handlers are the daemon's only while it runs: they are put back as they were on the
way out (as uvicorn's ``capture_signals``), and each step of the shutdown waits at most
``timeslice.agent.shutdown_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import signal
from pathlib import Path
from typing import Any, Iterator

from timeslice_verl import __version__
from timeslice_verl.agent.client import protocol
from timeslice_verl.agent.arbiter import Arbiter
from timeslice_verl.agent.connections import Connections
from timeslice_verl.agent.dispatch import Dispatcher
from timeslice_verl.agent.freeze import BackendUnavailable, make_backend
from timeslice_verl.agent.gpu import node_gpus, open_probe
from timeslice_verl.agent.tenant.hold import HoldPolicy
from timeslice_verl.agent.options import AgentOptions, TenantOptions
from timeslice_verl.agent.host import MAX_CONNECTIONS, AgentStartError, _QuietAccept, connection_limit  # noqa: F401
from timeslice_verl.agent.host import take_gpu_locks, take_instance_lock
from timeslice_verl.agent.tenant.ladder import SHORT_DEADLINE_S, budgets
from timeslice_verl.agent.site import UnixSite, private_directory, private_file
from timeslice_verl.agent.state import StateStore
from timeslice_verl.config.schema import TimesliceSettings, socket_path, state_path
from timeslice_verl.names import YieldBy
from timeslice_verl.log import get_logger

log = get_logger("agent")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class AgentServer:
    """The daemon's serving part: what it is (``hello``), its socket, its connections."""

    def __init__(self, settings: TimesliceSettings, arbiter: Arbiter, path: Path) -> None:
        self.settings, self.arbiter, self.path = settings, arbiter, path
        self.site = UnixSite(path)
        self.connections = Connections(arbiter, Dispatcher(arbiter, self.info))
        self._stop = asyncio.Event()

    def info(self) -> dict[str, Any]:
        backend = self.arbiter.executor.backend
        return {"agent_version": __version__, "protocol": protocol.PROTOCOL_VERSION, "pid": os.getpid(),
                "backend": backend.name, "backend_description": backend.description,
                "frees_gpu_memory": backend.frees_gpu_memory, "gpus": list(self.settings.agent.gpus),
                "socket": str(self.path), "started": self.arbiter.started, "settings": self.running_settings()}

    def running_settings(self) -> dict[str, Any]:
        """The ``agent`` and ``tenant`` sections this agent runs with (as the trainer would write them)."""
        out: dict[str, Any] = {}
        for name in ("agent", "tenant"):
            part = dataclasses.asdict(getattr(self.settings, name))
            out[name] = {k: (str(v) if isinstance(v, enum.Enum) else v) for k, v in part.items()}
        return out

    async def start(self) -> None:
        await self.site.start(self.connections.handle)

    async def serve_forever(self) -> None:
        with self._signals():
            await self._stop.wait()

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT shut down, SIGHUP is ignored, while the daemon serves; then the handlers are as before."""
        loop = asyncio.get_running_loop()
        before = {sig: signal.getsignal(sig) for sig in (*SIGNALS, signal.SIGHUP)}
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        # A closed terminal must not kill the agent mid-handoff (jobs left CUDA-locked): keep serving.
        loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP ignored: the agent keeps serving (stop it with SIGTERM)")
        try:
            yield
        finally:
            for sig, handler in before.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._stop.is_set():  # the user insists: leave now; the state file lets the next agent thaw
            jobs = self.arbiter.snapshot().get("jobs", [])
            log.error("%s again: exiting at once, without finishing the shutdown; jobs as recorded: %s. Start the "
                      "agent again with the same state file: it thaws what is left frozen and wakes the tenant",
                      name, [(j.get("name"), j.get("state")) for j in jobs if isinstance(j, dict)])
            logging.shutdown()
            os._exit(128 + sig)
        log.info("%s: shutting down (thawing frozen jobs, waking the tenant); send it again to exit at once", name)
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        """Stop listening, shut the arbiter down (thaw, wake), end the connections, remove the socket."""
        server = self.site.stop_listening()
        if server is None:
            return
        timeout = self.settings.agent.shutdown_timeout_s
        await self.arbiter.shutdown()
        await self.connections.close_all(timeout)
        try:
            await asyncio.wait_for(server.wait_closed(), timeout)
        except asyncio.TimeoutError:
            log.warning("connections still open %g s after closing the socket", timeout)
        self.site.remove()
        log.info("agent stopped")


def _arbiter(settings: TimesliceSettings, backend: Any, probe: Any, state: Path) -> Arbiter:
    a, t = settings.agent, settings.tenant
    agent = AgentOptions(reattach_grace_s=a.reattach_grace_s, park_overhead_bytes=int(a.park_overhead_gib * 2**30),
                         shutdown_timeout_s=a.shutdown_timeout_s)
    tenant = TenantOptions(request_timeout_s=t.request_timeout_s, drain_timeout_s=t.drain_timeout_s,
                           pause_mode=str(t.pause_mode), reclaim_deadline_s=t.reclaim_deadline_s,
                           pause_grant_s=t.pause_grant_s, probe_interval_s=t.probe_interval_s,
                           probe_timeout_s=t.probe_timeout_s, warm_up=t.warm_up,
                           hold=HoldPolicy(YieldBy(str(t.yield_by)), int(t.awake_margin_gib * 2**30)))
    return Arbiter(backend, StateStore(state), probe=probe, agent=agent, tenant=tenant)


def _backend(settings: TimesliceSettings, probe: Any) -> Any:
    try:
        backend = make_backend(settings.agent.backend, probe=probe, driver_timeout_s=settings.agent.driver_timeout_s,
                               cuda_checkpoint_bin=settings.agent.cuda_checkpoint_bin)
    except BackendUnavailable as exc:
        raise AgentStartError(f"timeslice.agent.backend={settings.agent.backend}: {exc}") from None
    backend.only_on_gpus = not settings.agent.freeze_off_gpu
    if not backend.frees_gpu_memory:
        log.warning("backend %s: %s", backend.name, backend.description)
    return backend


def _warn_short_deadline(settings: TimesliceSettings) -> None:
    deadline = settings.tenant.reclaim_deadline_s
    if 0 < deadline < SHORT_DEADLINE_S:
        log.warning("timeslice.tenant.reclaim_deadline_s=%g leaves the polite yield %.1f s: a behaving vLLM's first "
                    "/sleep pins its host backup (over a second on a large GPU), so the ladder may abort or kill it; %g s or more "
                    "is safe", deadline, budgets(deadline).polite_s, SHORT_DEADLINE_S)


async def run_agent(settings: TimesliceSettings, *, ready: asyncio.Event | None = None) -> None:
    """Build the backend, the arbiter and the server from ``settings``; serve until SIGTERM/SIGINT.

    Whatever was set up is undone in reverse order however the start or the run ends (the NVML probe, the locks,
    the arbiter's shutdown, the listening socket, the metrics endpoint).
    """
    path = socket_path(settings)
    asyncio.get_running_loop().set_exception_handler(_QuietAccept())
    async with contextlib.AsyncExitStack() as stack:
        if not settings.agent.gpus:
            try:
                settings.agent.gpus = node_gpus()
            except ValueError as exc:
                raise AgentStartError(str(exc)) from None
        probe = open_probe(settings.agent.gpus)
        if probe is not None:
            stack.callback(probe.close)
        backend = _backend(settings, probe)
        _warn_short_deadline(settings)
        state = state_path(settings).resolve()  # one file, however the path reaches it (links)
        private_directory(state.parent, "timeslice.agent.state_file")  # a planted state would name what to stop
        private_file(state, "timeslice.agent.state_file")
        arbiter = _arbiter(settings, backend, probe, state)
        gpu_ids = probe.uuids() if probe is not None else [str(i) for i in settings.agent.gpus]
        for fd in take_gpu_locks(Path(settings.agent.lock_dir), gpu_ids):
            stack.callback(os.close, fd)
        server = AgentServer(settings, arbiter, path)
        server.connections.max_connections = connection_limit()
        server.site.claim()
        stack.callback(os.close, take_instance_lock(state.with_name(state.name + ".lock")))  # one agent per state file
        stack.push_async_callback(arbiter.shutdown)  # reconcile with what the driver reports before serving anyone
        await arbiter.start(settings.tenant.urls, settings.tenant.sleep_level)
        stack.push_async_callback(server.close)
        await server.start()
        if settings.agent.metrics_port:
            from timeslice_verl.agent.metrics import start_exporter

            stack.callback(start_exporter(arbiter, settings.agent.metrics_host, settings.agent.metrics_port).close)
        log.info("agent %s listening on %s (backend %s, GPUs %s, tenant %s, state %s)", __version__, path, backend.name,
                 settings.agent.gpus, settings.tenant.urls or "none", state_path(settings))
        if ready is not None:
            ready.set()
        await server.serve_forever()


__all__ = ["AgentServer", "AgentStartError", "run_agent"]
