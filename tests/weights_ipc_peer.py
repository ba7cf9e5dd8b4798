"""The rollout side of the GPU test of verl's ``timeslice_ipc`` engine: a spawned process that answers, step by
step, the calls verl's ``CheckpointEngineManager`` makes on a rollout worker (prepare, init_process_group,
receive_weights consumed as vLLM's adapter does, finalize)."""

from __future__ import annotations

import asyncio
from typing import Any


def rollout_worker(conn: Any, device: int, bucket_size: int, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from timeslice_verl.weights_ipc import BACKEND, ENGINE_MODULE
    from timeslice_verl.weights_ipc.pushcheck import checksums

    torch.cuda.set_device(device)
    import_external_libs(ENGINE_MODULE)
    engine = CheckpointEngineRegistry.new(BACKEND, bucket_size=bucket_size)
    dst = {n: torch.empty(s, dtype=getattr(torch, d), device=f"cuda:{device}") for n, (s, d) in shapes.items()}
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "prepare":
            conn.send(("prepared", engine.prepare()))
        elif msg[0] == "init":
            engine.init_process_group(**msg[1])
            conn.send(("inited",))
        elif msg[0] == "receive":
            conn.send(("received", asyncio.run(_consume(engine, dst))))
        elif msg[0] == "finalize":
            engine.finalize()
            torch.cuda.synchronize()
            conn.send(("finalized", torch.cuda.memory_allocated(device)))
        elif msg[0] == "checksums":
            conn.send(("checksums", checksums(dst)))


async def _consume(engine: Any, dst: dict[str, Any]) -> int:
    count = 0
    async for name, tensor in engine.receive_weights(global_steps=1):
        dst[name].copy_(tensor, non_blocking=True)
        count += 1
    return count


def driver_checkpoint_cycle(pid: int, conn: Any) -> None:
    """In a process of its own (a process cannot checkpoint itself): the agent's freeze and thaw of ``pid`` with the
    CUDA driver's calls — lock, checkpoint (its GPU memory to the host), restore, unlock."""
    from timeslice_verl.agent.freeze.cuda_driver import CudaDriverPrimitives

    try:
        cuda = CudaDriverPrimitives()
        cuda.lock(pid, 30.0)
        cuda.checkpoint(pid)
        cuda.restore(pid)
        cuda.unlock(pid)
        conn.send(("ok", ""))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
