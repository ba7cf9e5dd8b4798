"""Real processes for batch tests: the batch service and the tenant supervisor (over the stand-in vLLM)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from agent_support import eventually, terminate

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_requests(path: Path, n: int, *, endpoint: str = "/v1/completions", model: str = "m",
                   max_tokens=lambda i: 4) -> list[str]:
    """A batch input file of ``n`` requests whose prompt names their ``custom_id``; the ids."""
    ids = [f"req-{i:05d}" for i in range(n)]
    with path.open("w") as f:
        for i, cid in enumerate(ids):
            body: dict[str, Any] = {"model": model, "max_tokens": max_tokens(i)}
            if endpoint == "/v1/chat/completions":
                body["messages"] = [{"role": "user", "content": cid}]
            else:
                body["prompt"] = cid
            f.write(json.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body}) + "\n")
    return ids


def create_batch(client: httpx.Client, path: Path, endpoint: str = "/v1/completions", **extra: Any) -> str:
    """Upload ``path`` and make a batch of it (``extra``: more fields of the request, ours among them); its id."""
    fid = client.post("/v1/files", files={"file": (path.name, path.read_bytes())}, data={"purpose": "batch"}).json()["id"]
    made = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": endpoint, "completion_window": "24h",
                                            **extra})
    assert made.status_code == 200, made.text
    return made.json()["id"]


def completed(client: httpx.Client, bid: str) -> dict[str, Any]:
    """The batch once it completed."""
    return eventually(lambda: (b := client.get(f"/v1/batches/{bid}").json())["status"] == "completed" and b,
                      what=f"batch {bid} done")


def output_lines(client: httpx.Client, batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished batch's output file, a line each."""
    return [json.loads(x) for x in client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]


class BatchServiceProc:
    """``timeslice-verl batch serve`` in its own process (so a test can ``kill -9`` it), its state in ``db``."""

    def __init__(self, tmp: Path, tenant_url: str, *, agent_socket: Path | None = None, extra: tuple[str, ...] = (),
                 command: tuple[str, ...] = ("serve",), env: dict[str, str] | None = None) -> None:
        """``command``: ``serve``, ``serve --api-only`` or ``feed``; ``env``: added to the process's (a DSN, a key)."""
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.port, self.env = tmp, free_port(), {**os.environ, **(env or {})}
        self.db = tmp / "batch.sqlite"
        self.key_file = tmp / "batch.key"
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [PY, "-m", "timeslice_verl", "--log-level", "DEBUG", "batch", *command,
                     "--set", f"timeslice.batch.port={self.port}", "--set", f"timeslice.batch.db={self.db}",
                     "--set", f"timeslice.batch.key_file={self.key_file}",
                     "--set", f'timeslice.batch.tenant_urls={json.dumps([tenant_url] if tenant_url else [])}', "--set", "timeslice.batch.poll_s=0.05",
                     "--set", f"timeslice.batch.follow_agent={'true' if agent_socket else 'false'}",
                     *(["--set", f"timeslice.agent.socket={agent_socket}"] if agent_socket else []),
                     *[a for kv in extra for a in ("--set", kv)]]
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> BatchServiceProc:
        self.starts += 1
        self._log = open(self.tmp / f"batch-{self.starts}.log", "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        eventually(self._up, what="the batch service answers")
        return self

    def _up(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the batch service exited ({self.proc.returncode}): {self.log()[-2000:]}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).is_success
        except httpx.HTTPError:
            return False

    @property
    def key(self) -> str:
        """The key the service made at its first start (a client's ``--api-key``), or the one it was given."""
        return self.env.get("TIMESLICE_BATCH_API_KEY") or self.key_file.read_text().strip()

    def http(self, timeout: float = 60) -> httpx.Client:
        """A client that sends the service's key."""
        return httpx.Client(base_url=self.url, timeout=timeout, headers={"Authorization": f"Bearer {self.key}"})

    def log(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.tmp.glob("batch-*.log")))

    def get(self, path: str) -> Any:
        resp = httpx.get(f"{self.url}{path}", timeout=30, headers={"Authorization": f"Bearer {self.key}"})
        resp.raise_for_status()
        return resp.json()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            terminate(self.proc)
            self._log.close()


class SupervisorProc:
    """``timeslice-verl tenant run -- <the stand-in vLLM>`` on a fixed port, registering with the agent at ``socket``."""

    def __init__(self, tmp: Path, socket_path: Path, *fake_args: str, port: int | None = None,
                 sup_args: tuple[str, ...] = (), name: str = "supervisor") -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k not in ("TIMESLICE_TENANT", "TIMESLICE_TENANT_SUPERVISOR")}
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [PY, "-m", "timeslice_verl", "--log-level", "DEBUG", "tenant", "run", "--backoff-max-s", "2", *sup_args,
             "--set", f"timeslice.agent.socket={socket_path}", "--",
             PY, "-m", "timeslice_verl.standin", "--port", str(self.port), *fake_args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        terminate(self.proc, 60)
        self._log.close()
