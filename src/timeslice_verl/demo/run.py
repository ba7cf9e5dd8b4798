"""``timeslice-verl demo``: an agent, a tenant and a trainer loop on one machine, then the timeline.

The trainer loop fires the real hooks through the real plugin manager (bundled agent, timeline and
metrics plugins plus any installed entry-point plugins) on a fully-async-like schedule: wait for a
batch, train on the GPU, sync weights, sometimes save. A worker process tagged ``TIMESLICE_JOB``
stands for verl's GPU worker; batch clients keep the tenant busy so its harvest can be counted.

* On a GPU machine: the CUDA driver backend freezes the worker (``--gib`` of device memory), and the
  tenant is a real vLLM (``--vllm-url`` of a server started with ``VLLM_SERVER_DEV_MODE=1
  --enable-sleep-mode``, or ``--vllm-model`` to start one) — else a simulated one, labelled.
* Without a GPU: a **dry run**, labelled as such everywhere — the CPU test backend (SIGSTOP/SIGCONT,
  no GPU memory moves) and the stand-in vLLM from ``timeslice_verl.testing``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from timeslice_verl import analysis
from timeslice_verl.agent.client import wait_for_agent
from timeslice_verl.agent.gpu import gpu_count
from timeslice_verl.config import NCCL_ENV
from timeslice_verl.overrides import compose
from timeslice_verl.events import CheckpointEvent, InitWorkersEvent, RolloutEvent, TrainStepEvent, WeightSyncEvent
from timeslice_verl.lifecycle import Lifecycle
from timeslice_verl.log import get_logger

log = get_logger("demo")
JOB = "demo"


@dataclass
class DemoOptions:
    out: Path = Path("timeslice-demo")
    steps: int = 8
    rollout_s: float = 1.5
    train_s: float = 0.5
    save_every: int = 4
    device: str = "auto"
    gib: float = 8.0
    vllm_url: str = ""
    vllm_model: str = ""
    clients: int = 4
    seed: int = 0


@dataclass
class DemoTrainer:
    """What hooks see of the trainer: verl's progress counters and its per-step metrics dict."""

    global_steps: int = 0
    current_param_version: int = 0
    local_trigger_step: int = 1
    required_samples: int = 16
    metrics: dict[str, Any] = field(default_factory=dict)


def gpu_available() -> bool:
    if gpu_count() < 1:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


class BatchClients:
    """Keep the tenant busy with completions; count what it served (the harvest)."""

    def __init__(self, url: str, n: int, max_tokens: int = 48) -> None:
        self.url = url.rstrip("/")
        self.n = n
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        self.completed = 0
        self.aborted = 0
        self.errors = 0
        self.tokens = 0
        self.model = "m"
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True, name=f"batch-{i}") for i in range(n)]

    def start(self) -> BatchClients:
        try:
            models = httpx.get(f"{self.url}/v1/models", timeout=10)
            if models.is_success and models.json().get("data"):
                self.model = models.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        for t in self.threads:
            t.start()
        return self

    def _loop(self) -> None:
        body = {"model": self.model, "prompt": "def fibonacci(n):", "max_tokens": self.max_tokens, "temperature": 0.0}
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                try:
                    resp = client.post(f"{self.url}/v1/completions", json=body)
                    resp.raise_for_status()
                    choice = resp.json()["choices"][0]
                    with self._lock:
                        if choice.get("finish_reason") == "abort":
                            self.aborted += 1
                        else:
                            self.completed += 1
                            self.tokens += int(resp.json().get("usage", {}).get("completion_tokens", 0))
                except (httpx.HTTPError, ValueError, KeyError):
                    with self._lock:
                        self.errors += 1
                    time.sleep(0.2)

    def finish(self, timeout: float = 60.0) -> dict[str, int]:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return {"completed": self.completed, "aborted": self.aborted, "errors": self.errors, "tokens": self.tokens}


class Worker:
    """The stand-in trainer worker process (``demo.worker``), tagged for ``job``; the benchmark uses it too."""

    def __init__(self, device: str, gib: float, log_path: Path, job: str = JOB) -> None:
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


def _start_vllm(model: str, out: Path) -> tuple[subprocess.Popen, str]:
    port = 8000 + random.randint(100, 900)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    logf = open(out / "vllm.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--enable-sleep-mode",
         "--gpu-memory-utilization", "0.35", "--port", str(port), "--host", "127.0.0.1"],
        stdout=logf, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited (see {out / 'vllm.log'})")
        try:
            if httpx.get(f"{url}/health", timeout=2).is_success:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("vLLM did not come up within 600 s")


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    timeline = out / "run.jsonl"
    timeline.unlink(missing_ok=True)
    rng = random.Random(opts.seed)

    gpu = opts.device == "cuda" or (opts.device == "auto" and gpu_available())
    backend = "cuda" if gpu else "sigstop"
    fake = None
    vllm_proc = None
    if opts.vllm_url:
        tenant_url, tenant_kind = opts.vllm_url, "real vLLM"
    elif opts.vllm_model:
        vllm_proc, tenant_url = _start_vllm(opts.vllm_model, out)
        tenant_kind = "real vLLM"
    else:
        from timeslice_verl.testing.fake_vllm import FakeVllmServer

        fake = FakeVllmServer(sleep_in_flight="crash", token_s=0.004).start()
        tenant_url, tenant_kind = fake.url, "SIMULATED vLLM (timeslice_verl.testing.fake_vllm)"
    dry = not gpu
    mode = {
        "dry_run": dry,
        "backend": backend,
        "tenant": tenant_kind,
        "label": ("DRY RUN on CPU: CPU test backend (SIGSTOP/SIGCONT — no GPU memory moves) + " + tenant_kind)
        if dry else f"GPU: CUDA driver checkpoint/restore + {tenant_kind}",
    }
    log.info("demo: %s", mode["label"])

    agent_log = open(out / "agent.log", "w")
    socket = run_dir / "agent.sock"
    agent = subprocess.Popen(
        [sys.executable, "-m", "timeslice_verl.cli", "agent", f"timeslice.agent.socket={socket}",
         f"timeslice.agent.backend={backend}", f"timeslice.tenant.url={tenant_url}",
         f"timeslice.agent.state_file={run_dir / 'agent-state.json'}",
         # the dry run's CPU backend touches no GPU: its GPU lock stays in its own folder
         *([f"timeslice.agent.lock_dir={run_dir}"] if backend == "sigstop" else [])],
        stdout=agent_log, stderr=subprocess.STDOUT,
    )
    worker: Worker | None = None
    clients: BatchClients | None = None
    lc: Lifecycle | None = None
    batch: dict[str, int] = {}
    try:
        wait_for_agent(socket, 60)
        settings = compose("interleave", [
            f"timeslice.job={JOB}", f"timeslice.agent.socket={socket}", f"timeslice.agent.backend={backend}",
            f"timeslice.tenant.url={tenant_url}", f"timeslice.timeline.path={timeline}",
        ])
        trainer = DemoTrainer()
        lc = Lifecycle.build(settings, trainer=trainer, adapter="demo")
        lc.start()
        clients = BatchClients(tenant_url, opts.clients, max_tokens=48 if gpu else 24).start()

        # init_workers: the job's GPU worker is created and loads its "model"
        t0 = time.monotonic()
        lc.call("init_workers_begin", lc.event(InitWorkersEvent))
        worker = Worker("cuda" if gpu else "cpu", opts.gib, out / "worker.log")
        lc.call("init_workers_end", lc.event(InitWorkersEvent, elapsed_s=round(time.monotonic() - t0, 6)))
        # the pre-fit weight sync fully_async_main runs before fit()
        lc.call("weight_sync_begin", lc.event(WeightSyncEvent, initial=True))
        time.sleep(0.05)
        lc.call("weight_sync_end", lc.event(WeightSyncEvent, initial=True, synced=True, elapsed_s=0.05))

        step_log = []
        for step in range(1, opts.steps + 1):
            trainer.global_steps, trainer.metrics = step, {}
            wait = opts.rollout_s * rng.uniform(0.8, 1.2)
            time.sleep(wait)  # the rollout engines produce the next batch; the trainer GPU idles
            lc.call("post_rollout", lc.event(RolloutEvent, samples=16, required_samples=16, queue_wait_s=round(wait, 6)))
            lc.call("pre_train_step", lc.event(TrainStepEvent, local_step=1, samples=16))
            done = worker.ask(f"step {opts.train_s * 1e3:.0f}")
            trainer.current_param_version += 1
            lc.call("weight_sync_begin", lc.event(WeightSyncEvent))
            time.sleep(0.05)
            lc.call("weight_sync_end", lc.event(WeightSyncEvent, synced=True, elapsed_s=0.05))
            if opts.save_every and step % opts.save_every == 0:
                lc.call("save_checkpoint_begin", lc.event(CheckpointEvent))
                time.sleep(0.1)
                lc.call("save_checkpoint_end", lc.event(CheckpointEvent, saved=True, elapsed_s=0.1))
            step_log.append({"step": step, "worker": done, **{k: v for k, v in trainer.metrics.items() if k.startswith("timeslice/")}})
            log.info("step %d: %s %s", step, done, {k: v for k, v in trainer.metrics.items() if k.startswith("timeslice/")})
        intact = worker.ask("check").split()[-1] == worker.checksum
        lc.stop("finished")
        lc = None
        batch = clients.finish()
        clients = None
    finally:
        if lc is not None:
            lc.stop("error")
        if clients is not None:
            batch = clients.finish(timeout=10)
        if agent.poll() is None:
            agent.terminate()
            try:
                agent.wait(120)
            except subprocess.TimeoutExpired:
                agent.kill()
        agent_log.close()
        if worker is not None:
            worker.stop()
        if fake is not None:
            fake.stop()
        if vllm_proc is not None:
            vllm_proc.terminate()

    records = analysis.load(timeline)
    summary = analysis.summary(records)
    summary["mode"] = mode
    summary["batch"] = batch
    summary["worker_data_intact"] = intact
    summary["steps_detail"] = step_log
    png = analysis.plot(records, out / "timeline.png", title="DRY RUN (CPU)" if dry else "GPU")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["files"] = {"timeline": str(timeline), "png": str(png), "summary": str(out / "summary.json"), "agent_log": str(out / "agent.log")}
    summary["options"] = {k: str(v) for k, v in asdict(opts).items()}
    return summary
