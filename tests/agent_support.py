"""Real processes for agent tests: the agent daemon, tagged job workers, the stand-in vLLM."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from timeslice_verl.agent.client import AgentClient, wait_for_agent

PY = sys.executable


def eventually(check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll ``check`` until it is true: the way tests wait for another process. ``timeout`` only ends a test
    that would hang (it is no measurement: timings are the benchmarks' business), so it is generous."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s (last: {last!r})")


def terminate(proc: subprocess.Popen | None, wait_s: float = 30.0) -> None:
    """SIGTERM, a bounded wait, then SIGKILL: how every helper process of the tests is stopped."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(wait_s)


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def stopped(pid: int) -> bool:
    return proc_state(pid) in ("T", "t")


def spawn_worker(job: str | None) -> subprocess.Popen:
    """A stand-in GPU worker: a busy process, tagged TIMESLICE_JOB=<job> (or untagged for None); returned
    once its environment (the tag) is readable in /proc, so the agent can find it."""
    env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_JOB"}
    if job is not None:
        env["TIMESLICE_JOB"] = job
    code = "import time\nwhile True:\n    time.sleep(0.005)\n"
    proc = subprocess.Popen([PY, "-c", code], env=env)
    _SPAWNED.append(proc)
    if job is not None:
        eventually(lambda: f"TIMESLICE_JOB={job}".encode() in _environ(proc.pid), what=f"worker {proc.pid} tagged")
    return proc


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


_SPAWNED: list[subprocess.Popen] = []


@atexit.register
def _kill_spawned() -> None:
    """A test that failed half-way must not leave tagged workers behind (they would join later tests' jobs)."""
    for proc in _SPAWNED:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            except OSError:
                pass


class AgentProc:
    def __init__(self, tmp: Path, *, tenant_url: str = "", extra: tuple[str, ...] = (),
                 preexec: Callable[[], None] | None = None) -> None:
        self.preexec = preexec
        """Run in the agent's process before it starts (resource limits)."""
        run = tmp / "run"
        run.mkdir(mode=0o700, exist_ok=True)
        self.socket = run / "agent.sock"
        self.state_file = run / "agent-state.json"
        self.log_path = tmp / f"agent-{int(time.time() * 1000)}.log"
        self.tenant_url = tenant_url
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> AgentProc:
        self._spawn()
        wait_for_agent(self.socket, timeout)
        return self

    def start_and_fail(self, timeout: float = 60.0) -> tuple[int, str]:
        """Start an agent expected to refuse: its exit status and what it wrote."""
        self._spawn()
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self._log.close()
        return code, self.log()

    def _spawn(self) -> None:
        args = [
            PY, "-m", "timeslice_verl", "--log-level", "DEBUG", "agent",
            f"timeslice.agent.socket={self.socket}",
            "timeslice.agent.backend=sigstop",
            f"timeslice.tenant.url={self.tenant_url}",
            f"timeslice.agent.lock_dir={self.socket.parent}",  # this test's own "machine": one agent per GPU in it
            "timeslice.tenant.warm_up=false",  # these tests count the tenant's moves; the warm-up's own tests turn it on
            *self.extra,  # later overrides win (e.g. timeslice.agent.backend=cuda)
        ]
        self.log_path = self.log_path.with_name(f"agent-{int(time.time() * 1000)}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=self.preexec)

    def client(self, **kwargs: Any) -> AgentClient:
        kwargs.setdefault("connect_timeout_s", 10.0)
        return AgentClient(self.socket, **kwargs)

    def status(self) -> dict[str, Any]:
        with self.client() as c:
            return c.status()

    def job(self, name: str) -> dict[str, Any] | None:
        return next((j for j in self.status()["jobs"] if j["name"] == name), None)

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(30)

    def stop(self) -> None:
        terminate(self.proc)
        if self.proc is not None:
            self._log.close()


class FakeVllmProc:
    def __init__(self, *args: str, tagged: bool = False) -> None:
        """``tagged``: started with ``TIMESLICE_TENANT=1``, so the reclaim ladder may kill it."""
        env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_TENANT"}
        if tagged:
            env["TIMESLICE_TENANT"] = "1"
        self.proc = subprocess.Popen(
            [PY, "-m", "timeslice_verl.standin", "--port", "0", *args], stdout=subprocess.PIPE, text=True, env=env
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("listening on "), line
        self.url = line.split()[-1]

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    def stats(self) -> dict[str, Any]:
        return self.get("/_standin/stats")

    def sleeping(self) -> bool:
        return bool(self.get("/is_sleeping")["is_sleeping"])

    def complete(self, max_tokens: int, timeout: float = 60) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps({"prompt": "hi", "max_tokens": max_tokens}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


def agent_with_a_tenant_per_gpu(tmp: Path, procs: list, gpus: int = 2, extra: tuple[str, ...] = ()) -> tuple[AgentProc, list[FakeVllmProc]]:
    """One agent (CPU test backend) lending to a stand-in vLLM per "GPU" (``timeslice.tenant.urls``)."""
    tenants = [FakeVllmProc() for _ in range(gpus)]
    procs.extend(tenants)
    urls = ",".join(f'"{t.url}"' for t in tenants)
    agent = AgentProc(tmp, extra=(f"timeslice.tenant.urls=[{urls}]", *extra)).start()
    procs.append(agent)
    return agent, tenants


@contextlib.contextmanager
def node(tmp_path: Path, job: str, *vllm_args: str, extra: tuple[str, ...] = ()):
    """A stand-in vLLM (with ``vllm_args``), a worker tagged ``job`` and an agent serving both; all stopped after."""
    vllm = FakeVllmProc(*vllm_args)
    worker = spawn_worker(job)
    agent = AgentProc(tmp_path, tenant_url=vllm.url, extra=extra).start()
    try:
        yield agent, vllm, worker
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        agent.stop()
        vllm.stop()
