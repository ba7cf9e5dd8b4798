"""``timeslice-verl demo``: an agent, a tenant and a trainer loop on one machine, then the timeline.

The trainer loop fires the real hooks through the real plugin manager (bundled agent, timeline and
metrics plugins plus any installed entry-point plugins) on a fully-async-like schedule: wait for a
batch from the rollout's queue, train on the GPU, sync weights, sometimes save. A worker process tagged
``TIMESLICE_JOB`` stands for verl's GPU worker and parks its tensors on a GPU like verl's workers do; the
queue's backlog lets the handoff skip valleys that cannot pay (:mod:`timeslice_verl.demo.trainer`). Batch
clients keep the tenant busy so its harvest can be counted. ``solo`` runs the same schedule with
``+timeslice=observe`` (no agent, no tenant): the baseline a time-sliced run is compared with.

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
import statistics
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
from timeslice_verl.demo.trainer import DemoRanks, DemoRollout, schedule
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
    burst_every: int = 0
    """Every k-th batch comes 20x faster (the next batch is already queued at the release: a skip)."""
    solo: bool = False
    """The same schedule with ``+timeslice=observe``: no agent, no tenant (the baseline)."""
    overrides: tuple[str, ...] = ()
    """More ``timeslice.…`` overrides for the interleave section (e.g. ``timeslice.handoff.swap=checkpoint``)."""


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


def end_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, wait up to ``timeout_s`` for a clean exit, then SIGKILL: a process the demo started."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_vllm(model: str, out: Path) -> tuple[subprocess.Popen, str]:
    port = 8000 + random.randint(100, 900)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TIMESLICE_TENANT="1")  # started here: the ladder may stop it
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


def _tenant(opts: DemoOptions, out: Path) -> tuple[str, str, Any, Any]:
    """(url, kind, the stand-in server or None, the started vLLM process or None)."""
    if opts.solo:
        return "", "no tenant (solo)", None, None
    if opts.vllm_url:
        return opts.vllm_url, "real vLLM", None, None
    if opts.vllm_model:
        proc, url = start_vllm(opts.vllm_model, out)
        return url, "real vLLM", None, proc
    from timeslice_verl.testing.fake_vllm import FakeVllmServer

    fake = FakeVllmServer(sleep_in_flight="crash", token_s=0.004).start()
    return fake.url, "SIMULATED vLLM (timeslice_verl.testing.fake_vllm)", fake, None


def _train(lc: Lifecycle, trainer: DemoTrainer, worker: Worker, rollout: DemoRollout, opts: DemoOptions) -> list[dict[str, Any]]:
    """The fully-async step loop; one record per step (``step_s``: from asking for the batch to the end of
    the weight sync, like verl's ``timing_s/step``)."""
    step_log = []
    for step in range(1, opts.steps + 1):
        trainer.global_steps, trainer.metrics = step, {}
        t0 = time.monotonic()
        wait = rollout.take()  # the rollout produces the next batch elsewhere; the trainer GPU idles
        lc.call("post_rollout", lc.event(RolloutEvent, samples=rollout.required, required_samples=rollout.required,
                                         queue_wait_s=round(wait, 6)))
        lc.call("pre_train_step", lc.event(TrainStepEvent, local_step=1, samples=rollout.required))
        done = worker.ask(f"step {opts.train_s * 1e3:.0f}")
        trainer.current_param_version += 1
        save = bool(opts.save_every) and step % opts.save_every == 0
        lc.call("weight_sync_begin", lc.event(WeightSyncEvent))
        time.sleep(0.05)
        lc.call("weight_sync_end", lc.event(WeightSyncEvent, synced=True, elapsed_s=0.05, save_follows=save))
        if save:  # the adapters tell the same: the GPU is released after the save, not before it
            lc.call("save_checkpoint_begin", lc.event(CheckpointEvent))
            time.sleep(0.1)
            lc.call("save_checkpoint_end", lc.event(CheckpointEvent, saved=True, elapsed_s=0.1))
        metrics = {k: v for k, v in trainer.metrics.items() if k.startswith("timeslice/")}
        step_log.append({"step": step, "step_s": round(time.monotonic() - t0, 6), "wait_s": round(wait, 6),
                         "worker": done, **metrics})
        log.info("step %d: %s %s", step, done, metrics)
    return step_log


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    timeline = out / "run.jsonl"
    timeline.unlink(missing_ok=True)

    compose("interleave", list(opts.overrides))  # a refused override fails here, before anything starts
    gpu = opts.device == "cuda" or (opts.device == "auto" and gpu_available())
    backend = "cuda" if gpu else "sigstop"
    tenant_url, tenant_kind, fake, vllm_proc = _tenant(opts, out)
    dry = not gpu
    mode = {
        "dry_run": dry,
        "solo": opts.solo,
        "backend": backend,
        "tenant": tenant_kind,
        "label": ("DRY RUN on CPU: CPU test backend (SIGSTOP/SIGCONT — no GPU memory moves) + " + tenant_kind)
        if dry else f"GPU: CUDA driver (lock, checkpoint/restore) + {tenant_kind}",
    }
    log.info("demo: %s", mode["label"])

    agent = agent_log = None
    socket = run_dir / "agent.sock"
    if not opts.solo:
        agent_log = open(out / "agent.log", "w")
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
    rollout = DemoRollout(schedule(opts.steps, opts.rollout_s, burst_every=opts.burst_every, seed=opts.seed))
    batch: dict[str, int] = {}
    try:
        if opts.solo:
            settings = compose("observe", [f"timeslice.job={JOB}", f"timeslice.timeline.path={timeline}"])
        else:
            wait_for_agent(socket, 60)
            settings = compose("interleave", [
                f"timeslice.job={JOB}", f"timeslice.agent.socket={socket}", f"timeslice.agent.backend={backend}",
                f"timeslice.tenant.url={tenant_url}", f"timeslice.timeline.path={timeline}", *opts.overrides,
            ])
        trainer = DemoTrainer()
        ranks = DemoRanks(None)
        lc = Lifecycle.build(settings, trainer=trainer, adapter="demo", workers=ranks, backlog=rollout.backlog)
        lc.start()
        if tenant_url:
            clients = BatchClients(tenant_url, opts.clients, max_tokens=48 if gpu else 24).start()

        # init_workers: the job's GPU worker is created and loads its "model"
        t0 = time.monotonic()
        lc.call("init_workers_begin", lc.event(InitWorkersEvent))
        worker = ranks.worker = Worker("cuda" if gpu else "cpu", opts.gib, out / "worker.log")
        lc.call("init_workers_end", lc.event(InitWorkersEvent, elapsed_s=round(time.monotonic() - t0, 6)))
        # fully_async_main builds the rollouter (its vLLM servers) next: a valley of its own
        time.sleep(opts.rollout_s)
        # the pre-fit weight sync fully_async_main runs before fit(); then the rollouter starts
        lc.call("weight_sync_begin", lc.event(WeightSyncEvent, initial=True))
        time.sleep(0.05)
        lc.call("weight_sync_end", lc.event(WeightSyncEvent, initial=True, synced=True, elapsed_s=0.05))
        rollout.start()
        step_log = _train(lc, trainer, worker, rollout, opts)
        lc.stop("finished")  # the GPU comes back (thawed, unparked) and the agent forgets the job
        lc = None
        intact = worker.ask("check").split()[-1] == worker.checksum
        if clients is not None:
            batch = clients.finish()
            clients = None
    finally:
        rollout.stop()
        if lc is not None:
            lc.stop("error")
        if clients is not None:
            batch = clients.finish(timeout=10)
        if agent is not None:
            end_process(agent, 120)  # SIGTERM: the agent thaws what it froze and wakes its tenant
        if agent_log is not None:
            agent_log.close()
        if worker is not None:
            worker.stop()
        if fake is not None:
            fake.stop()
        if vllm_proc is not None:
            end_process(vllm_proc, 60)  # its GPU memory is free when the demo returns

    records = analysis.load(timeline)
    summary = analysis.summary(records)
    summary["mode"] = mode
    summary["batch"] = batch
    summary["worker_data_intact"] = intact
    summary["steps_detail"] = step_log
    summary["step_s_median"] = round(statistics.median(s["step_s"] for s in step_log), 6) if step_log else None
    title = ("DRY RUN (CPU)" if dry else "GPU") + (" solo" if opts.solo else "")
    png = analysis.plot(records, out / "timeline.png", title=title)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["files"] = {"timeline": str(timeline), "png": str(png), "summary": str(out / "summary.json")}
    if agent is not None:
        summary["files"]["agent_log"] = str(out / "agent.log")
    summary["options"] = {k: str(v) for k, v in asdict(opts).items()}
    return summary
