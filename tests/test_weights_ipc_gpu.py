"""The same-GPU CUDA IPC weight transfer on a real GPU: two processes, one GPU.

Run there with ``python -m pytest -m gpu -s tests/test_weights_ipc_gpu.py`` (or ``benchmarks/ipc_push.py`` for the
table); without a GPU they are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from timeslice_verl.weights_ipc.pushcheck import MIB, PushRig, checksums, copy_rate

pytestmark = pytest.mark.gpu

GIB = 1 << 30
NVML_SLACK = 32 * MIB
"""What the driver may keep per process after an update (its own bookkeeping); a leaked bucket is far larger."""


def _nvml_back(rig: PushRig, record, reference: dict) -> None:
    for pid, used in record.nvml.items():
        if used is not None and reference.get(pid) is not None:
            assert used <= reference[pid] + NVML_SLACK, (pid, used, reference[pid])


def test_a_gigabyte_push_between_two_processes_on_one_gpu_is_bit_exact_and_leaves_memory_as_found():
    pytest.importorskip("torch")
    rig = PushRig(GIB, 256 * MIB)
    try:
        assert rig.bytes >= GIB
        records = [rig.update() for _ in range(3)]
        assert rig.bit_exact(), "checksums differ between sender and receiver"
    finally:
        rig.close()
    rate = copy_rate(rig.bytes)
    best = min(r.push_s for r in records)
    print(f"\npushed {rig.bytes / 1e9:.3f} GB in {best:.4f} s: {rig.bytes / best / 1e9:.1f} GB/s; "
          f"this GPU's copy_: {rate / 1e9:.1f} GB/s; ratio {rig.bytes / best / rate:.2f}; NVML {records[-1].nvml}")
    for r in records:
        assert r.bytes == rig.bytes and r.tensors_received == len(rig.specs)
        assert r.sender_clean and r.receiver_clean
        assert r.sender_allocated == rig.sender_baseline and r.receiver_allocated == rig.receiver_baseline
        _nvml_back(rig, r, rig.nvml_baseline)


def test_a_hundred_updates_grow_no_memory_in_either_process():
    pytest.importorskip("torch")
    rig = PushRig(32 * MIB, 8 * MIB)
    try:
        records = [rig.update() for _ in range(100)]
        assert rig.bit_exact()
    finally:
        rig.close()
    first = records[0]
    for r in records:
        assert r.sender_clean and r.receiver_clean and r.tensors_received == len(rig.specs)
        assert r.sender_allocated == rig.sender_baseline and r.receiver_allocated == rig.receiver_baseline
        _nvml_back(rig, r, rig.nvml_baseline)
        for pid, used in r.nvml.items():  # nothing accumulates after the first update
            if used is not None and first.nvml.get(pid) is not None:
                assert used <= first.nvml[pid] + 2 * MIB, (pid, used, first.nvml[pid])


def test_no_handle_outlives_an_update_either_side_survives_a_driver_checkpoint_between_updates():
    """``swap=checkpoint`` moves the trainer's GPU memory to the host with the CUDA driver, which refuses memory shared
    over IPC: between updates neither side may hold a bucket or an opened handle, and the next push still works."""
    pytest.importorskip("torch")
    import os

    import torch.multiprocessing as mp

    from timeslice_verl.agent.freeze.base import BackendUnavailable
    from timeslice_verl.agent.freeze.cuda_driver import CudaDriverPrimitives
    from weights_ipc_peer import driver_checkpoint_cycle

    try:
        CudaDriverPrimitives()
    except BackendUnavailable as exc:
        pytest.skip(f"no CUDA checkpoint here: {exc}")
    ctx = mp.get_context("spawn")
    rig = PushRig(256 * MIB, 64 * MIB)
    try:
        rig.update()
        for pid, side in ((os.getpid(), "sender"), (rig.child_pid, "receiver")):
            mine, theirs = ctx.Pipe()
            cycle = ctx.Process(target=driver_checkpoint_cycle, args=(pid, theirs), daemon=True)
            cycle.start()
            assert mine.poll(120), f"the {side}'s checkpoint cycle did not answer"
            assert mine.recv() == ("ok", ""), side
            cycle.join(30)
            record = rig.update()
            assert record.sender_clean and record.receiver_clean, side
        assert rig.bit_exact(), "checksums differ after the checkpoints"
    finally:
        rig.close()


@pytest.mark.verl
def test_verls_engine_moves_weights_through_the_managers_call_sequence():
    """Actor rank 0 here, a rollout worker in a spawned process; the calls in verl's order, three updates."""
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as mp
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from timeslice_verl.weights_ipc import BACKEND, ENGINE_MODULE
    from timeslice_verl.weights_ipc.pushcheck import make_weights, weight_specs
    from weights_ipc_peer import rollout_worker

    bucket = 64 * MIB
    torch.cuda.set_device(0)
    specs = weight_specs(256 * MIB, bucket)
    import_external_libs(ENGINE_MODULE)
    engine = CheckpointEngineRegistry.new(BACKEND, is_master=True, bucket_size=bucket)
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=rollout_worker, args=(child_end, 0, bucket, {s.name: (s.shape, s.dtype) for s in specs}),
                        daemon=True)
    child.start()

    def answer():
        assert conn.poll(300), f"rollout worker silent (alive: {child.is_alive()})"
        return conn.recv()

    def ask(*msg):
        conn.send(msg)
        return answer()

    try:
        for step in range(3):
            weights = make_weights(specs, 0, seed=step)
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            metadata = [engine.prepare(), ask("prepare")[1]]
            actor_kwargs, rollout_kwargs = type(engine).build_topology(1, 1, metadata)
            engine.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
            ask("init", {k: v[0] for k, v in rollout_kwargs.items()})
            received: list = []
            receiver = threading.Thread(target=lambda: received.append(ask("receive")))
            receiver.start()
            metrics = asyncio.run(engine.send_weights(iter(weights.items()), global_steps=step))
            receiver.join(300)
            assert received and received[0][1] == len(specs)
            assert metrics["timeslice_ipc/bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
            conn.send(("finalize",))  # verl finalizes both sides at once: the sender waits for the release
            engine.finalize()
            assert answer()[0] == "finalized"
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == baseline
            assert ask("checksums")[1] == checksums(weights), f"update {step} is not bit-exact"
            del weights
    finally:
        conn.send(("stop",))
        child.join(60)
