"""``timeslice-verl tenant run -- vllm serve MODEL …``: the node's tenant, started the way the agent needs it and
brought back whenever it dies.

The supervisor starts vLLM with sleep mode (``--enable-sleep-mode`` added when missing), the development endpoints
(``VLLM_SERVER_DEV_MODE=1``) and the ``TIMESLICE_TENANT`` tag (so the reclaim ladder may stop it); before each start
it waits until the GPU has the memory vLLM will ask for (``--gpu-memory-utilization`` of it), so a tenant restarted
while the trainer holds the GPU does not fail vLLM's check and crash-loop. Once the server answers ``/health`` it
registers it with the node's agent, saying how often it was restarted and why, which ``timeslice-verl status``
shows. A server that exits — a crash, the ladder's kill — is started again after a backoff (1 s doubling, at most
``--backoff-max-s``; a run that lasted 10 minutes resets it), and so is one that does not answer within
``--start-timeout-s``. The tenant's processes are one unit (:mod:`timeslice_verl.supervisor.process`): stopped together
when the server exits or the supervisor gets SIGTERM, bound to the supervisor's life, and any an earlier,
killed supervisor left behind are stopped before the first start; a port another process serves is refused.

``--gpu auto`` starts vLLM on the GPU the agent sees the job's processes on (the Kubernetes DaemonSet's way: no GPU
index written down); ``--gpu N`` on that one; by default where ``CUDA_VISIBLE_DEVICES`` says.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timeslice_verl.backoff import Backoff
from timeslice_verl.log import get_logger
from timeslice_verl.supervisor import process

log = get_logger("tenant")

STABLE_S = 600.0
"""A server that ran this long before it exited restarts after the shortest backoff again."""
MEMORY_MARGIN_BYTES = 512 * 2**20
STOP_GRACE_S = 30.0
"""How long the tenant's processes have after SIGTERM before SIGKILL."""


@dataclass
class TenantCommand:
    """The server's command line as the supervisor runs it, and what it reads off it."""

    argv: list[str]
    url: str
    gpu_utilization: float = 0.9

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @classmethod
    def parse(cls, argv: list[str]) -> TenantCommand:
        if not argv:
            raise ValueError("no command: give the server's, after --, e.g. -- vllm serve MODEL --port 8000")
        args, port, host, util = list(argv), 8000, "127.0.0.1", 0.9
        for i, arg in enumerate(args):
            key, _, inline = arg.partition("=")
            value = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
            try:
                if key == "--port":
                    port = int(value)
                elif key == "--host" and value not in ("0.0.0.0", "::", ""):
                    host = value
                elif key == "--gpu-memory-utilization":
                    util = float(value)
            except ValueError:
                raise ValueError(f"{key} {value!r} is not a number") from None
        if any("vllm" in a for a in args[:3]) and "--enable-sleep-mode" not in args:
            args.append("--enable-sleep-mode")  # the agent puts it to sleep in the trainer's steps
        if not 0 < util <= 1:
            raise ValueError(f"--gpu-memory-utilization {util} is not in (0, 1]")
        return cls(args, f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}", util)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class Supervisor:
    command: TenantCommand
    agent_socket: str | None = None
    gpu: str = ""
    """``auto``, an index or a UUID; empty: as ``CUDA_VISIBLE_DEVICES`` is."""
    max_restarts: int = 0
    """0: restart for ever."""
    backoff_max_s: float = 60.0
    start_timeout_s: float = 1800.0
    wait_for_memory: bool = True
    register_url: str = ""
    """The URL the agent reaches the server at (its own pod's loopback is not the agent's: in Kubernetes the
    node-local Service, the URL the agent was started with); empty: the command's own."""
    lock_path: Path | None = None
    """One supervisor per server address: a second one for the same port refuses to start (it would stop the
    first one's server as an orphan)."""
    restarts: int = 0
    last_exit: str = ""
    exited_at: float = 0.0
    """When the server last exited (wall clock): with the next registration, the restart's length."""
    stopping: threading.Event = field(default_factory=threading.Event)
    proc: subprocess.Popen | None = None

    def run(self) -> int:
        """Run and bring back the server until stopped (0), out of restarts (1), its port is another's or its
        command cannot be started (2)."""
        try:
            lock = process.hold_lock(self.lock_path) if self.lock_path else None
        except process.Taken as exc:
            log.error("tenant: %s", exc)
            return 2
        try:
            return self._run()
        finally:
            if lock is not None:
                lock.close()

    def _run(self) -> int:
        left = process.stop_tenant(self.command.url, STOP_GRACE_S, "left by an earlier supervisor")
        if left:
            log.warning("tenant: stopped %d process(es) an earlier supervisor of %s left running", left, self.command.url)
        if self._answers():
            log.error("tenant: %s already answers, served by %s that this supervisor did not start: stop it or give "
                      "the server another --port", self.command.url, self._serving() or "a process not visible to you")
            return 2
        try:
            return self._loop()
        finally:
            process.stop_tenant(self.command.url, STOP_GRACE_S, "the supervisor stops")

    def _loop(self) -> int:
        again, backoff = Backoff(1.0, self.backoff_max_s), 0.0
        while not self.stopping.is_set():
            gpu = self._gpu()
            if gpu is None:
                return 0
            if self.wait_for_memory and not self._room(gpu):
                return 0
            started = time.monotonic()
            try:
                self.proc = self._start(gpu)
            except OSError as exc:  # not found, not executable: no restart would bring it
                log.error("tenant: cannot start %r: %s", self.command.argv[0], exc.strerror or exc)
                return 2
            why = self._healthy(self.proc)
            if not why:
                self._register(self.proc, time.monotonic() - started)
                code = self._wait(self.proc)
                why = describe_exit(code) if code is not None else ""
            if self.stopping.is_set():
                return 0
            process.stop_tenant(self.command.url, STOP_GRACE_S, why)  # what it left: the engine core, its children
            self.exited_at = time.time()
            self.last_exit = f"{why} at {time.strftime('%H:%M:%S')}"
            self.restarts += 1
            log.error("tenant: the server %s (%s restart(s) so far)", self.last_exit, self.restarts)
            if self.max_restarts and self.restarts > self.max_restarts:
                log.error("tenant: %d restarts: giving up (--max-restarts)", self.max_restarts)
                return 1
            backoff = again.first_s if time.monotonic() - started > STABLE_S else again.next(backoff)
            if self.stopping.wait(backoff):
                return 0
        return 0

    def stop(self, *_: Any) -> None:
        """SIGTERM: stop every process of the tenant (SIGTERM, SIGKILL after 30 s) and do not start it again."""
        self.stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()  # the rest of the tenant is stopped by ``run`` as it returns

    def _wait(self, proc: subprocess.Popen) -> int | None:
        """The server's exit status; None when the supervisor was stopped first."""
        while not self.stopping.is_set():
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                continue
        return None

    # ------------------------------------------------------------------ one start

    def _start(self, gpu: str) -> subprocess.Popen:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TIMESLICE_TENANT="1")
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        proc = process.spawn(self.command.argv, env, self.command.url)
        log.info("tenant: started %s (pid %d%s) for %s", self.command.argv[0], proc.pid, f", GPU {gpu}" if gpu else "",
                 self.command.url)
        return proc

    def _healthy(self, proc: subprocess.Popen) -> str:
        """Wait until this start's own server answers ``/health``: "" then, else why not (it exited, it did not
        answer within ``start_timeout_s``, another process answers on its port)."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not self.stopping.is_set():
            if proc.poll() is not None:
                return describe_exit(proc.returncode)
            if self._answers():
                serving = self._serving()
                if serving and not serving & process.tree(proc.pid):  # empty: not visible to us, trusted
                    log.error("tenant: %s answers, but from pid %s, not this supervisor's server (pid %d)",
                              self.command.url, ", ".join(map(str, sorted(serving))), proc.pid)
                    return "another process answered on its port"
                log.info("tenant: %s answers", self.command.url)
                return ""
            self.stopping.wait(0.5)
        if self.stopping.is_set():
            return ""
        log.error("tenant: %s did not answer /health within %.0f s (--start-timeout-s): stopping it to start again",
                  self.command.url, self.start_timeout_s)
        return f"not healthy within {self.start_timeout_s:.0f} s"

    def _answers(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.command.url}/health", timeout=2).is_success
        except httpx.HTTPError:
            return False

    def _serving(self) -> set[int]:
        return process.listeners(self.command.port)

    def _register(self, proc: subprocess.Popen, start_s: float) -> None:
        """Tell the agent the server is back (it takes it as its tenant at once, and puts it to sleep if a trainer
        holds the GPU); an agent that is not there yet registers it at its own start."""
        if not self.agent_socket:
            return
        from timeslice_verl.agent.client import AgentClient, AgentError

        now = time.time()
        info = {"pid": proc.pid, "restarts": self.restarts, "started": now, "start_s": round(start_s, 3),
                **({"last_exit": self.last_exit, "restart_s": round(now - self.exited_at, 3)} if self.last_exit else {})}
        try:
            with AgentClient(self.agent_socket, connect_timeout_s=5.0, client="tenant-supervisor") as agent:
                agent.register_tenant([self.register_url or self.command.url], supervisor=info)
        except AgentError as exc:
            log.warning("tenant: could not register %s with the agent on %s: %s", self.register_url or self.command.url,
                        self.agent_socket, exc)

    # ------------------------------------------------------------------ where, and when there is room

    def _gpu(self) -> str | None:
        """The GPU to start on (``""``: as the environment says); None when stopped while waiting for one."""
        if self.gpu != "auto":
            return self.gpu
        from timeslice_verl.agent.client import AgentClient, AgentError

        said = 0.0
        while not self.stopping.is_set():
            try:
                with AgentClient(self.agent_socket or "", connect_timeout_s=2.0, client="tenant-supervisor") as agent:
                    jobs = agent.status().get("jobs", [])
            except AgentError as exc:
                jobs, why = [], str(exc)
            else:
                why = "no job of the agent runs on a GPU yet"
            for job in jobs:
                if job.get("gpu_uuids"):
                    return str(job["gpu_uuids"][0])
            if time.monotonic() - said > 30:
                said = time.monotonic()
                log.warning("tenant: --gpu auto: waiting until the agent on %s sees a trainer's tagged processes on a "
                            "GPU (%s); start the trainer, or give --gpu N to start on GPU N now", self.agent_socket, why)
            self.stopping.wait(2.0)
        return None

    def _room(self, gpu: str) -> bool:
        """Wait until the GPU has what vLLM will ask for; True then (False: stopped while waiting). Without NVML at once."""
        from timeslice_verl.supervisor.memory import free_and_total

        said = 0.0
        while not self.stopping.is_set():
            seen = free_and_total(gpu)
            if seen is None:
                return True
            free, total = seen
            need = int(total * self.command.gpu_utilization) + MEMORY_MARGIN_BYTES
            if free >= need:
                return True
            if time.monotonic() - said > 30:
                said = time.monotonic()
                log.info("tenant: waiting for %.1f GiB free on GPU %s (%.1f GiB free: the trainer holds it)",
                         need / 2**30, gpu or "0", free / 2**30)
            self.stopping.wait(2.0)
        return False


__all__ = ["Supervisor", "TenantCommand", "describe_exit"]
