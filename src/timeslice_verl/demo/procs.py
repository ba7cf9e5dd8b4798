"""The processes the demo (and the benchmarks) start, each ended one way whatever happens: the agent, the tenant
under ``timeslice-verl tenant run``, the batch service, and the stand-in trainer worker."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from timeslice_verl.agent.client import AgentClient, wait_for_agent
from timeslice_verl.config.schema import NCCL_ENV
from timeslice_verl.log import get_logger

log = get_logger("demo")

CLI = [sys.executable, "-m", "timeslice_verl"]
JOB = "demo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, wait up to ``timeout_s`` for a clean exit, then SIGKILL: a process the demo started."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Spawned:
    """A process the demo started, its output in ``log``; ``stop`` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, argv: list[str], log_path: Path, *, stop_timeout_s: float = 60.0, env: dict | None = None) -> None:
        self.log_path, self.stop_timeout_s = log_path, stop_timeout_s
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_http(self, url: str, timeout_s: float, what: str) -> None:
        """Until ``url`` answers 2xx; a clear error naming the log when the process exits or never answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {self.proc.returncode} (see {self.log_path})")
            try:
                if httpx.get(url, timeout=2).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{what} did not answer at {url} within {timeout_s:.0f} s (see {self.log_path})")

    def stop(self) -> None:
        end_process(self.proc, self.stop_timeout_s)
        self._log.close()


def start_agent(out: Path, run_dir: Path, backend: str, tenant_urls: list[str]) -> Spawned:
    """The agent, its tenant ``tenant_urls`` (one server, or a group that yields and wakes together)."""
    sock = run_dir / "agent.sock"
    agent = Spawned([*CLI, "agent", f"timeslice.agent.socket={sock}", f"timeslice.agent.backend={backend}",
                     f"timeslice.tenant.urls={json.dumps(tenant_urls)}",
                     f"timeslice.agent.state_file={run_dir / 'agent-state.json'}",
                     # the dry run's CPU backend touches no GPU: its GPU lock stays in its own folder
                     *([f"timeslice.agent.lock_dir={run_dir}"] if backend == "sigstop" else [])],
                    out / "agent.log", stop_timeout_s=120)  # SIGTERM: it thaws what it froze and wakes its tenant
    wait_for_agent(sock, 60)
    return agent


def wait_tenant_warm(sock: Path, timeout_s: float = 120.0) -> None:
    """Until the agent has its tenant registered and warmed up (:mod:`timeslice_verl.agent.tenant.warmup`): a trainer
    started meanwhile would pay the tenant's one-off first sleep, which a user's does not (their agent and tenant
    are up long before the run)."""
    deadline = time.monotonic() + timeout_s
    with AgentClient(sock, connect_timeout_s=10) as client:
        while time.monotonic() < deadline:
            tenant = client.status().get("tenant") or {}
            if tenant.get("state") in ("awake", "asleep") and not tenant.get("warming"):
                return  # registered (a configured tenant that has not answered yet is recorded dead) and warm
            time.sleep(0.2)
    log.warning("the agent's tenant was not registered and warmed up within %.0f s: starting the trainer anyway", timeout_s)


def tenant_command(vllm_model: str, port: int, vllm_args: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """The server the supervisor runs, and what it is: vLLM on ``vllm_model`` (``vllm_args`` added; a
    ``--gpu-memory-utilization`` there replaces the demo's 0.35), else the stand-in (labelled)."""
    if vllm_model:
        util = [] if any(a.startswith("--gpu-memory-utilization") for a in vllm_args) else ["--gpu-memory-utilization", "0.35"]
        return ([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model, *util,
                 "--host", "127.0.0.1", "--port", str(port), *vllm_args], "real vLLM")
    return ([sys.executable, "-m", "timeslice_verl.standin", "--port", str(port), "--token-s", "0.004",
             "--knee", "64", "--max-num-seqs", "256"],  # a GPU's shape: tokens/s stop growing past 64 running
            "SIMULATED vLLM (timeslice_verl.standin)")


def start_tenant(out: Path, agent_socket: Path, vllm_model: str, port: int,
                 vllm_args: tuple[str, ...] = (), name: str = "tenant") -> tuple[Spawned, str, str]:
    """The tenant under ``timeslice-verl tenant run`` on ``port`` (the supervisor restarts it and registers it with
    the agent, which must be up); its log ``out/<name>.log``."""
    command, kind = tenant_command(vllm_model, port, vllm_args)
    sup = Spawned([*CLI, "tenant", "run", "--set", f"timeslice.agent.socket={agent_socket}", "--", *command],
                  out / f"{name}.log", stop_timeout_s=60)
    url = f"http://127.0.0.1:{port}"
    try:
        sup.wait_http(f"{url}/health", 900 if vllm_model else 60, "the tenant's supervisor")
    except BaseException:
        sup.stop()
        raise
    return sup, url, f"{kind} under timeslice-verl tenant run"


def start_vllm(model: str, out: Path, port: int, vllm_args: tuple[str, ...] = ()) -> tuple[Spawned, str]:
    """vLLM on ``model`` by itself (tagged, so the reclaim ladder may stop it): one tenant for several runs, each
    with its own agent (a supervised tenant registers with one agent)."""
    command, _ = tenant_command(model, port, vllm_args)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TIMESLICE_TENANT="1")
    proc = Spawned([*command, "--enable-sleep-mode"], out / "vllm.log", stop_timeout_s=60, env=env)
    url = f"http://127.0.0.1:{port}"
    return _answering(proc, f"{url}/health", 900, "vLLM"), url


def _answering(proc: Spawned, health: str, timeout_s: float, what: str) -> Spawned:
    """``proc`` once ``health`` answers; stopped, and the error raised, when it does not."""
    try:
        proc.wait_http(health, timeout_s, what)
    except BaseException:
        proc.stop()
        raise
    return proc


def start_batch_service(out: Path, agent_socket: Path | None, tenant_url: str,
                        concurrency: int, extra: tuple[str, ...] = ()) -> tuple[Spawned, str, str]:
    """The batch service, its state (database and key) in ``out/batch-state`` (0700); it, its URL, its key
    (``extra``: more ``timeslice.batch.KEY=VALUE`` settings)."""
    port, state = free_port(), out / "batch-state"
    service = Spawned([*CLI, "batch", "serve", *[a for kv in (
        f"timeslice.batch.port={port}", f"timeslice.batch.db={state / 'batch.sqlite'}",
        f"timeslice.batch.key_file={state / 'batch.key'}",
        f'timeslice.batch.tenant_urls=["{tenant_url}"]', f"timeslice.batch.concurrency={max(1, concurrency)}",
        f"timeslice.batch.follow_agent={'true' if agent_socket else 'false'}",
        *([f"timeslice.agent.socket={agent_socket}"] if agent_socket else []), *extra) for a in ("--set", kv)]],
        out / "batch.log", stop_timeout_s=30)
    url = f"http://127.0.0.1:{port}"
    service = _answering(service, f"{url}/health", 60, "the batch service")
    from timeslice_verl.batch.auth import client_key

    return service, url, client_key(str(state / "batch.key"))


class Worker:
    """The stand-in trainer worker process (``demo.worker``), tagged for ``job``; the benchmarks use it too."""

    def __init__(self, device: str, gib: float, log_path: Path, job: str = JOB) -> None:
        self.device = device
        self._lock = threading.Lock()  # the way back unparks from its own thread
        env = dict(os.environ, TIMESLICE_JOB=job, **NCCL_ENV)
        self.stderr = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "timeslice_verl.demo.worker", "--device", device, "--gib", str(gib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env,
        )
        ready = (self.proc.stdout.readline() or "").split()  # type: ignore[union-attr]
        if not ready or ready[0] != "ready":
            raise RuntimeError(f"demo worker failed to start (see {log_path})")
        self.nbytes, self.checksum = int(ready[1]), ready[2]

    def ask(self, line: str) -> str:
        with self._lock:
            self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            return (self.proc.stdout.readline() or "").strip()  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):  # a broken pipe or a hung worker
                self.proc.kill()
        self.stderr.close()


__all__ = ["CLI", "JOB", "Spawned", "Worker", "end_process", "free_port", "start_agent", "start_batch_service",
           "start_tenant", "start_vllm", "tenant_command", "wait_tenant_warm"]
