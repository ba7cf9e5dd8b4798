"""``timeslice-verl demo``: an agent, a tenant, a batch service and a trainer loop on one machine, then the timeline.

The trainer loop fires the real hooks through the real plugin manager (bundled agent, timeline and metrics plugins
plus any installed entry-point plugins) on a fully-async-like schedule: wait for a batch from the rollout's queue
(samples arriving evenly, or shaped like verl's rollouter: ``--profile``), train on the GPU, sync weights, sometimes
save. A worker process tagged ``TIMESLICE_JOB`` stands for verl's GPU worker and parks its tensors on a GPU like
verl's workers do; the queue's backlog lets the handoff skip valleys that cannot pay. The tenant runs under
``timeslice-verl tenant run`` (restarted if it dies) and its work is one batch submitted to ``timeslice-verl batch
serve``, which feeds it while it has the GPU. ``solo`` runs the same schedule with ``+timeslice=observe`` (no agent,
no tenant): the baseline a time-sliced run is compared with.

* On a GPU machine: the CUDA driver backend, the worker holding ``--gib`` of device memory, and a real vLLM
  (``--vllm-model`` to start one under the supervisor, or ``--vllm-url`` of a running one) — else the stand-in.
* Without a GPU: a **dry run**, labelled as such everywhere — the CPU test backend (SIGSTOP/SIGCONT, no GPU memory
  moves) and the stand-in vLLM (:mod:`timeslice_verl.standin`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from timeslice_verl.agent.client import AgentClient, AgentError
from timeslice_verl.agent.gpu import gpu_count
from timeslice_verl.config.overrides import compose
from timeslice_verl.demo import validation
from timeslice_verl.demo.batch import DemoBatch
from timeslice_verl.demo.earlier import set_aside
from timeslice_verl.demo.faults import TenantStop
from timeslice_verl.demo.procs import (JOB, Spawned, Worker, free_port, start_agent, start_batch_service, start_tenant,
                                       wait_tenant_warm)
from timeslice_verl.demo.trainer import DemoRanks, DemoRollout, schedule
from timeslice_verl.hooks.events import CheckpointEvent, InitWorkersEvent, RolloutEvent, TrainStepEvent, WeightSyncEvent
from timeslice_verl.hooks.lifecycle import Lifecycle
from timeslice_verl.log import get_logger
from timeslice_verl import analysis

log = get_logger("demo")



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
    vllm_args: tuple[str, ...] = ()
    """More arguments for the vLLM the demo starts (``--vllm-model``)."""
    clients: int = 4
    """Requests the batch service keeps in flight at the tenant."""
    seed: int = 0
    burst_every: int = 0
    """Every k-th batch comes 20x faster (the next batch is already queued at the release: a skip); ``even`` only."""
    profile: str = "even"
    """How samples arrive: ``even`` over each batch, or a profile of :mod:`~timeslice_verl.demo.arrivals`."""
    required: int = 0
    """Samples a step takes (0: 16 for ``even``, 32 for a profile)."""
    batch_lines: int = 0
    """0: 20 000 on a GPU, 1 000 in the dry run (about what its valleys answer)."""
    finish_batch_s: float = -1.0
    """After the last step, let the batch complete for up to this long before the rest is cancelled (-1: 0 on a GPU,
    120 s in the dry run, where the rest of a batch sized to the run takes seconds)."""
    max_tokens: int = 0
    """Tokens a batch line asks for (0: 48 on a GPU, 24 in the dry run)."""
    wedge_at: int = 0
    """Stop the tenant (SIGSTOP) in this step's valley: the ladder kills it, the supervisor brings it back."""
    solo: bool = False
    """The same schedule with ``+timeslice=observe``: no agent, no tenant (the baseline)."""
    overrides: tuple[str, ...] = ()
    """More ``timeslice.…`` overrides for the interleave section (e.g. ``timeslice.handoff.swap=checkpoint``)."""
    batch_overrides: tuple[str, ...] = ()
    """More ``timeslice.batch.…`` settings for the batch service (e.g. ``timeslice.batch.spread=true``)."""
    validate_every: int = 0
    """Validate every this many versions in the valleys (:mod:`~timeslice_verl.demo.validation`); 0: off."""
    policy_url: str = ""
    """The policy tenant: a running vLLM with weight transfer (default: a stand-in under ``tenant run``)."""
    policy_model: str = ""
    """The Hugging Face model the trainer holds and pushes (the one the policy tenant serves; GPU)."""


@dataclass
class DemoTrainer:
    """What hooks see of the trainer: verl's progress counters and its per-step metrics dict."""

    global_steps: int = 0
    current_param_version: int = 0
    local_trigger_step: int = 1
    required_samples: int = 16
    metrics: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    """What validation reads of verl's config (with ``--validate-every``)."""
    logger: Any = None
    """verl's tracker: the validations' metrics, each at its version's step."""
    model: Any = None
    """The weights the trainer changes at every step and validation pushes (with ``--validate-every``)."""


def gpu_available() -> bool:
    if gpu_count() < 1:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@dataclass
class Node:
    """What runs beside the trainer, ended in the one order that loses nothing: the batch service, then the agent
    (it thaws the worker and wakes the tenant), then the worker, then the tenant."""

    socket: Path | None = None
    tenant_url: str = ""
    policy_url: str = ""
    tenant_kind: str = "no tenant (solo)"
    agent: Spawned | None = None
    tenant: Spawned | None = None
    policy: Spawned | None = None
    service: Spawned | None = None
    service_url: str = ""
    worker: Worker | None = None
    batch: DemoBatch | None = None
    stop_tenant: TenantStop | None = None

    def status(self) -> dict[str, Any]:
        if self.socket is None:
            return {}
        try:
            with AgentClient(self.socket, connect_timeout_s=10, client="demo") as agent:
                return agent.status()
        except AgentError as exc:
            log.error("demo: no agent status: %s", exc)
            return {}

    def stop(self) -> None:
        if self.stop_tenant is not None:
            self.stop_tenant.close()
        for part in (self.service, self.agent, self.worker, self.tenant, self.policy):
            if part is not None:
                part.stop()


def _rollout(opts: DemoOptions) -> DemoRollout:
    if opts.profile == "even":
        return DemoRollout(schedule(opts.steps, opts.rollout_s, burst_every=opts.burst_every, seed=opts.seed),
                           required=opts.required or 16)
    return DemoRollout.profiled(opts.profile, required=opts.required or 32, batch_s=opts.rollout_s, seed=opts.seed)


def _start_node(opts: DemoOptions, out: Path, backend: str, node: Node) -> None:
    """The agent, the tenant (under its supervisor, or one already running) and the batch service."""
    if opts.solo:
        return
    run_dir = out / "run"
    node.socket = run_dir / "agent.sock"
    port = 0 if opts.vllm_url else free_port()
    node.tenant_url = opts.vllm_url.rstrip("/") or f"http://127.0.0.1:{port}"
    policy_port = 0 if opts.policy_url or not opts.validate_every else free_port()
    node.policy_url = opts.policy_url.rstrip("/") or (f"http://127.0.0.1:{policy_port}" if policy_port else "")
    node.agent = start_agent(out, run_dir, backend, [node.tenant_url, *([node.policy_url] if node.policy_url else [])])
    if opts.vllm_url:
        node.tenant_kind = "real vLLM (running already)"
    else:
        node.tenant, _, node.tenant_kind = start_tenant(out, node.socket, opts.vllm_model, port, opts.vllm_args)
    if policy_port:  # the policy tenant's stand-in, under its own supervisor: a member of the agent's group
        node.policy, _, _ = start_tenant(out, node.socket, "", policy_port, name="policy-tenant")
    wait_tenant_warm(node.socket)
    policy = (f"timeslice.validate.policy_url={node.policy_url}",) if node.policy_url else ()
    node.service, service_url, key = start_batch_service(out, node.socket, node.tenant_url, opts.clients,
                                                         (*policy, *opts.batch_overrides))
    node.service_url = service_url
    tokens = opts.max_tokens or (48 if backend == "cuda" else 24)
    lines = opts.batch_lines or (20000 if backend == "cuda" else 1000)
    node.batch = DemoBatch(service_url, key, node.tenant_url, out, lines=lines, max_tokens=tokens).submit()
    if opts.wedge_at:
        node.stop_tenant = TenantStop(node.socket, opts.wedge_at)


def _settings(opts: DemoOptions, node: Node, backend: str, timeline: Path, out: Path) -> Any:
    if opts.solo:
        return compose("observe", [f"timeslice.job={JOB}", f"timeslice.timeline.path={timeline}"])
    validate = validation.overrides(node.policy_url, node.service_url, out / "batch-state" / "batch.key") \
        if opts.validate_every else []
    return compose("interleave", [
        f"timeslice.job={JOB}", f"timeslice.agent.socket={node.socket}", f"timeslice.agent.backend={backend}",
        f"timeslice.tenant.url={node.tenant_url}", f"timeslice.timeline.path={timeline}", *validate, *opts.overrides])


def _train(lc: Lifecycle, trainer: DemoTrainer, node: Node, rollout: DemoRollout, opts: DemoOptions) -> list[dict[str, Any]]:
    """The fully-async step loop; one record per step (``step_s``: from asking for the batch to the end of
    the weight sync, like verl's ``timing_s/step``)."""
    step_log, worker, stop = [], node.worker, node.stop_tenant
    assert worker is not None
    for step in range(1, opts.steps + 1):
        trainer.global_steps, trainer.metrics = step, {}
        t0 = time.monotonic()
        if stop is not None:
            stop.arm(step)
        wait = rollout.take()  # the rollout produces the next batch elsewhere; the trainer GPU idles
        lc.post_rollout(lc.event(RolloutEvent, samples=rollout.required, required_samples=rollout.required,
                                 queue_wait_s=round(wait, 6)))
        lc.pre_train_step(lc.event(TrainStepEvent, local_step=1, samples=rollout.required))
        if stop is not None:
            stop.reclaimed_in(step)
        done = worker.ask(f"step {opts.train_s * 1e3:.0f}")
        if trainer.model is not None:
            trainer.model.step()  # the weights change: what a validation of this version must be answered by
        trainer.current_param_version += 1
        _sync_and_save(lc, rollout, save=bool(opts.save_every) and step % opts.save_every == 0)
        if trainer.model is not None and not opts.solo:
            validation.synced(trainer, lc)  # as the adapters' validation seam: submitted, never awaited
        metrics = {k: v for k, v in trainer.metrics.items() if k.startswith("timeslice/")}
        step_log.append({"step": step, "step_s": round(time.monotonic() - t0, 6), "wait_s": round(wait, 6),
                         "worker": done, **metrics})
        log.info("%s", step_line(step_log[-1]))
    return step_log


def step_line(record: dict[str, Any]) -> str:
    """A step's record as a person reads it: its time, what it waited for, then the handoff's figures by name."""
    ms = record["worker"].split()[-1] if record["worker"].startswith("done ") else "?"
    figures = []
    for key, value in record.items():
        if not key.startswith("timeslice/"):
            continue
        name, number = key.removeprefix("timeslice/"), isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and name.endswith("_gib"):
            figures.append(f"{name.removesuffix('_gib').replace('_', ' ')} {value:.2f} GiB")
        elif number and name.endswith("_s"):
            figures.append(f"{name.removesuffix('_s').replace('_', ' ')} {value * 1e3:.1f} ms")
        else:
            figures.append(f"{name.replace('_', ' ')} {value}")
    return (f"step {record['step']}: {record['step_s']:.3f} s (waited {record['wait_s']:.3f} s for its batch, "
            f"trained {ms} ms)" + "".join(f" · {f}" for f in figures))


def _sync_and_save(lc: Lifecycle, rollout: DemoRollout, *, save: bool, initial: bool = False) -> None:
    lc.weight_sync_begin(lc.event(WeightSyncEvent, initial=initial))
    rollout.sync()  # the rollouter's requests in flight wait for the new weights (partial rollout)
    time.sleep(0.05)
    lc.weight_sync_end(lc.event(WeightSyncEvent, initial=initial, synced=True, elapsed_s=0.05, save_follows=save))
    if save:  # the adapters tell the same: the GPU is released after the save, not before it
        lc.save_checkpoint_begin(lc.event(CheckpointEvent))
        time.sleep(0.1)
        lc.save_checkpoint_end(lc.event(CheckpointEvent, saved=True, elapsed_s=0.1))


def _run(opts: DemoOptions, node: Node, settings: Any, rollout: DemoRollout, gpu: bool, out: Path) -> dict[str, Any]:
    """init_workers, the rollouter's start, the steps; what the run says of itself beyond its timeline."""
    trainer, ranks = DemoTrainer(required_samples=rollout.required), DemoRanks(None)
    if opts.validate_every:
        validation.equip(trainer, out, opts.validate_every, opts.policy_model, "cuda" if gpu else "cpu", opts.seed)
    lc: Lifecycle | None = Lifecycle.build(settings, trainer=trainer, adapter="demo", ranks=ranks, backlog=rollout.backlog)
    try:
        lc.start()
        t0 = time.monotonic()
        lc.init_workers_begin(lc.event(InitWorkersEvent))  # the job's GPU worker is created and loads its "model"
        node.worker = ranks.worker = Worker("cuda" if gpu else "cpu", opts.gib, out / "worker.log")
        lc.init_workers_end(lc.event(InitWorkersEvent, elapsed_s=round(time.monotonic() - t0, 6)))
        time.sleep(opts.rollout_s)  # fully_async_main builds the rollouter (its vLLM servers) next: a valley of its own
        _sync_and_save(lc, rollout, save=False, initial=True)  # the pre-fit weight sync; then the rollouter starts
        rollout.start()
        step_log = _train(lc, trainer, node, rollout, opts)
        lc.stop("finished")  # the GPU comes back (thawed, unparked) and the agent forgets the job
        lc = None  # the last validations run in the valley the run's end leaves: the tenants have the GPU
        extra_validation = validation.finish(trainer, 600.0) if trainer.model is not None and not opts.solo else None
        extra = {"steps_detail": step_log, "worker_data_intact": node.worker.ask("check").split()[-1] == node.worker.checksum}
        finish = opts.finish_batch_s if opts.finish_batch_s >= 0 else (0.0 if gpu else 120.0)
        extra["batch"] = node.batch.finish(complete_within_s=finish) if node.batch is not None else {}
        if extra_validation is not None:
            extra["validation"] = extra_validation
        if node.stop_tenant is not None:  # after the batch's last lines: a restart can come after the last step
            extra["tenant_stop"] = node.stop_tenant.figures(node.status(), step_log)
        return extra
    finally:
        if lc is not None:
            lc.stop("error")


def _mode(opts: DemoOptions, gpu: bool, node: Node) -> dict[str, Any]:
    backend = "cuda" if gpu else "sigstop"
    label = (f"GPU: CUDA driver (lock, checkpoint/restore) + {node.tenant_kind}" if gpu else
             f"DRY RUN on CPU: CPU test backend (SIGSTOP/SIGCONT — no GPU memory moves) + {node.tenant_kind}")
    return {"dry_run": not gpu, "solo": opts.solo, "backend": backend, "tenant": node.tenant_kind,
            "profile": opts.profile, "label": label}


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    out = opts.out.resolve()
    (out / "run").mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(out / "run", 0o700)
    timeline = out / "run.jsonl"
    compose("interleave", list(opts.overrides))  # a refused override fails here, before anything starts
    earlier = set_aside(out)  # the run before this one, kept whole
    gpu = opts.device == "cuda" or (opts.device == "auto" and gpu_available())
    rollout = _rollout(opts)
    node = Node()
    with contextlib.ExitStack() as stack:
        stack.callback(node.stop)
        stack.callback(rollout.stop)
        _start_node(opts, out, "cuda" if gpu else "sigstop", node)
        log.info("demo: %s", _mode(opts, gpu, node)["label"])
        extra = _run(opts, node, _settings(opts, node, "cuda" if gpu else "sigstop", timeline, out), rollout, gpu, out)
    records = analysis.load(timeline)
    summary = {**analysis.summary(records), **extra, "mode": _mode(opts, gpu, node)}
    step_log = extra["steps_detail"]
    summary["step_s_median"] = round(statistics.median(s["step_s"] for s in step_log), 6) if step_log else None
    title = ("DRY RUN (CPU)" if not gpu else "GPU") + (" solo" if opts.solo else "")
    png = analysis.plot(records, out / "timeline.png", title=title)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["files"] = {"timeline": str(timeline), "png": str(png), "summary": str(out / "summary.json")}
    for name in ("agent.log", "tenant.log", "batch.log"):
        if (out / name).exists():
            summary["files"][name.replace(".", "_")] = str(out / name)
    if earlier is not None:
        summary["files"]["earlier"] = str(earlier)
    summary["options"] = {k: str(v) for k, v in asdict(opts).items()}
    return summary


__all__ = ["DemoOptions", "DemoTrainer", "gpu_available", "run_demo"]
