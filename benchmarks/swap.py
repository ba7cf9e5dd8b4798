"""Swap benchmark: checkpoint vs park vs park+checkpoint, side by side in one run, with a real vLLM tenant.

    # one GPU (the agent and the vLLM tenant already running; the trainer is this process):
    python benchmarks/swap.py --socket S --tenants http://127.0.0.1:8001 --valley 25 --cycles 3 --out DIR
    # every rank of an FSDP2 trainer (one agent for the node's GPUs, one tenant per GPU):
    torchrun --nproc-per-node 2 benchmarks/swap.py --socket S --tenants URL0,URL1 --valley 1.5 --cycles 20 ...

The trainer (:mod:`standin`, an fp32 MLP with AdamW; FSDP2 over NCCL with several ranks) first trains
``cycles + 1`` steps alone (the solo phase: it holds the GPU, the tenant sleeps), then for each swap mode
and prepare setting starts again from the same seed and repeats: release → valley (the tenant serves)
→ acquire → train one step. Handoffs go through :class:`~timeslice_verl.handoff.spmd.RankHandoff` and the
node's agent. The first cycle of each phase is a warm-up with a short valley; the table covers the others.

Columns: P1 trainer-visible wait at acquire; P3 swap-out time over the time a pinned copy of
the same bytes takes (rate measured in this run); bytes moved / live tensor bytes; GPU memory left while
released (NVML); P4 step time / solo step time; P5 tenant serving time / trainer idle time; P6 batch lines
failed for good (the batch service retries what a handoff cost). ``--verify`` also checks that parameters and optimizer state are bit-identical
after every cycle; losses are compared with the solo phase's step by step. ``--record
benchmarks/results/swap/DATE-MACHINE`` (rank 0) packs ``--out`` into the run's folder beside its manifest.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import StandIn  # noqa: E402
from readers.common import add_record_arguments, record  # noqa: E402
from swap_report import report  # noqa: E402

from timeslice_verl.handoff.spmd import RankHandoff  # noqa: E402

log = logging.getLogger("timeslice.bench")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_rate(nbytes: int, device: torch.device) -> float:
    """Bytes per second of a device→pinned-host copy of ``nbytes`` (median of 3)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    empty_cache(device)
    return nbytes / sorted(times)[1]


def empty_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated(device: torch.device, model: StandIn) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else model.state_bytes()


def transitions(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result.get("transitions", [])) if result else []


def run_phase(args: argparse.Namespace, h: RankHandoff, mode: str, prepare: bool, lead_s: float, device: torch.device,
              clients: list[Any]) -> dict[str, Any]:
    model = StandIn(width=args.width, depth=args.depth, batch=args.batch, micro=args.micro, device=device)
    h.swap = mode
    h.parker.scan()
    phase: dict[str, Any] = {"mode": mode, "prepare": prepare, "cycles": [], "losses": [], "lead_s": lead_s,
                             "load_before": counts(clients)}
    loss, step_s = model.step()
    phase["losses"].append(loss)
    for cycle in range(args.cycles):
        valley = args.warmup_valley if cycle == 0 else args.valley
        snap = model.snapshot() if args.verify else None
        sync(device)
        rec: dict[str, Any] = {"cycle": cycle, "valley_s": valley, "live": allocated(device, model)}
        rec["t_release"] = time.time()
        rel = h.release()
        rec["t_released"] = time.time()
        rec.update(park_s=rel.park_s, parked=rel.parked, release_agent_s=rel.agent_s)
        rec["transitions"] = transitions(rel.agent)
        wake_at = rec["t_release"] + valley
        if prepare:
            time.sleep(max(0.0, wake_at - lead_s - time.time()))
            rec["t_prepare"] = time.time()
            h.prepare()
        time.sleep(max(0.0, wake_at - time.time()))
        rec["t_acquire"] = time.time()
        acq = h.acquire()
        rec["t_acquired"] = time.time()
        rec.update(acquire_s=acq.seconds, unpark_s=acq.park_s, acquire_agent_s=acq.agent_s)
        rec["transitions"] += transitions(acq.agent)
        if snap is not None:
            rec["identical"] = model.identical_to(snap)
        loss, step_s = model.step()
        rec.update(loss=loss, step_s=step_s, t_stepped=time.time())
        phase["losses"].append(loss)
        phase["cycles"].append(rec)
        log.info("%s prepare=%s cycle %d: release %.3fs (park %.3fs) acquire %.3fs (unpark %.3fs) step %.3fs loss %.6f",
                 mode, prepare, cycle, rel.seconds, rel.park_s, acq.seconds, acq.park_s, step_s, loss)
    phase["load_after"] = counts(clients)
    model.close()
    del model
    empty_cache(device)
    return phase


class TenantLoad:
    """One tenant's batch work: a batch service in front of it and one submitted batch (its lines outlast the run)."""

    def __init__(self, url: str, out: Path, concurrency: int) -> None:
        from timeslice_verl.demo.batch import DemoBatch
        from timeslice_verl.demo.procs import start_batch_service

        out.mkdir(parents=True, exist_ok=True)
        self.service, service_url, key = start_batch_service(out, None, url, concurrency)
        self.batch = DemoBatch(service_url, key, url, out, lines=50000, max_tokens=64).submit()

    def counts(self) -> dict[str, int]:
        fig = self.batch.client.figures(self.batch.id)
        return {"completed": fig["completed"], "retried": fig["retried"], "failed": sum(fig["failed"].values())}

    def finish(self) -> dict[str, Any]:
        try:
            return self.batch.finish()
        finally:
            self.service.stop()


def counts(clients: list[Any]) -> dict[str, int]:
    total = {"completed": 0, "retried": 0, "failed": 0}
    for c in clients:
        for key, n in c.counts().items():
            total[key] += n
    return total


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--job", default="swap-bench")
    p.add_argument("--tenants", default="", help="comma-separated vLLM URLs to keep busy (rank 0 sends the load)")
    p.add_argument("--clients", type=int, default=8, help="batch clients per tenant")
    p.add_argument("--modes", default="checkpoint,park,park+checkpoint")
    p.add_argument("--prepare", default="no,yes")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--valley", type=float, default=25.0)
    p.add_argument("--warmup-valley", type=float, default=3.0)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=11)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run (sigstop agent, gloo)")
    add_record_arguments(p)
    return p.parse_args()


def main() -> int:
    args = _arguments()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = None
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank() if world > 1 else 0
    clients: list[Any] = []
    if rank == 0 and args.tenants:
        clients = [TenantLoad(u, Path(args.out) / f"batch-{i}", args.clients) for i, u in enumerate(args.tenants.split(","))]
    h = RankHandoff(args.job, args.socket, swap="park", group=group)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))  # the ranks one node agent freezes
    result: dict[str, Any] = {"world": world, "local_world": local_world, "gpu": name, "args": vars(args), "phases": []}
    try:
        solo = StandIn(width=args.width, depth=args.depth, batch=args.batch, micro=args.micro, device=device)
        h.start()  # the leader registers every rank and acquires; every rank pins its host buffer (estimate)
        solo_steps = [solo.step() for _ in range(args.cycles + 1)]
        # the pinned-copy reference: the same bytes as the trainer's state once gradients and Adam exist
        result["state_bytes"] = solo.state_bytes()
        result["pinned_rate"] = pinned_rate(result["state_bytes"], device)
        result["solo"] = {"losses": [s[0] for s in solo_steps], "step_s": [s[1] for s in solo_steps],
                          "state_bytes": solo.state_bytes()}
        solo.close()
        del solo
        empty_cache(device)
        for mode in args.modes.split(","):
            lead = 0.0
            for prepare in [x == "yes" for x in args.prepare.split(",")]:
                phase = run_phase(args, h, mode, prepare, lead, device, clients)
                result["phases"].append(phase)
                waits = sorted(c["acquire_s"] for c in phase["cycles"][1:]) or [1.0]
                lead = 1.5 * waits[len(waits) // 2] + 0.5  # the prepare phase starts this early
    finally:
        try:
            h.close()  # the job ends: the tenant wakes and the clients' queued requests finish
        except Exception as exc:  # report what ran even when the last handoff failed
            log.error("close: %s", exc)
        for c in clients:
            c.finish()
    per_rank = [result]
    if group is not None:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, result, group=group)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "swap.json").write_text(json.dumps({"ranks": per_rank}, indent=1, default=str))
        print(report(per_rank, out, title=args.title))
        rows = json.loads((out / "rows.json").read_text())
        record(args, "swap", sorted(out.iterdir()), f"{world} rank(s), valley {args.valley} s; trainer wait at acquire "
               "(median): " + ", ".join(f"{r['mode']}{' prepared' if r.get('prepare') else ''} {r['p1_med']:.3f} s"
                                        for r in rows))
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # every rank has its results written and its process group destroyed: leave without running C++ static
    # destructors, where gloo's threads sometimes abort ("terminate called without an active exception")
    os._exit(code)
