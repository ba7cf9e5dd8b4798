"""verl checkpoint engine ``timeslice_ipc``: trainer → rollout weights over CUDA IPC, both on ONE GPU.

Importing this module registers the engine in verl's ``CheckpointEngineRegistry``; verl imports it itself when
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=timeslice_verl.weights_ipc.engine`` and
``...checkpoint_engine.backend=timeslice_ipc`` (``+timeslice=one_gpu`` sets both, see :mod:`timeslice_verl.weights_ipc`).

How verl drives it (``CheckpointEngineManager.update_weights``, per weight sync, from the trainer actor):

1. ``prepare()`` on every actor rank and every rollout worker (``execute_checkpoint_engine``, concurrently): actor
   rank 0 (``is_master``) opens the control socket; every process reports its device.
2. ``build_topology(...)`` (classmethod, in the trainer actor's process): refuses any rollout worker that is not on
   actor rank 0's GPU, naming both devices; actor rank 0 sends, other actor ranks only walk their weights.
3. ``init_process_group(**kwargs)`` everywhere: each process learns its role (no waiting here).
4. ``send_weights(generator)`` on actor ranks (from ``update_weights``), concurrently with ``receive_weights()``
   on rollout workers (``CheckpointEngineWorker.update_weights``, which hands the pairs to vLLM's server adapter).
5. ``finalize()`` everywhere: receivers close their mappings, the sender then frees its buckets and socket.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, AsyncGenerator

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from timeslice_verl.log import get_logger
from timeslice_verl.weights_ipc import BACKEND, METRIC_BUCKETS, METRIC_BYTES, METRIC_SECONDS
from timeslice_verl.weights_ipc.channel import Address
from timeslice_verl.weights_ipc.devices import DeviceIdentity, check_same_device, local_device
from timeslice_verl.weights_ipc.transport import TIMEOUT_S, Receiver, Sender

log = get_logger("weights_ipc")
if log.level == logging.NOTSET:  # verl's processes log WARNING and up; the line per push belongs in verl's log
    log.setLevel(logging.INFO)


class Role(str, enum.Enum):
    SENDER = "sender"
    BYSTANDER = "bystander"
    """An actor rank other than 0: its weights are the same, it only walks the generator (which is collective)."""
    RECEIVER = "receiver"


@dataclass(frozen=True)
class PeerInfo:
    """What ``prepare()`` reports: the process's device, and the sender's socket (actor rank 0 only)."""

    device: DeviceIdentity
    address: Address | None = None


@CheckpointEngineRegistry.register(BACKEND)
class TimesliceIPCCheckpointEngine(CheckpointEngine):
    """Same-GPU CUDA IPC checkpoint engine (double-buffered buckets of ``bucket_size`` bytes on the trainer)."""

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = TIMEOUT_S) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout_s = float(timeout_s)
        self.role: Role | None = None
        self.receivers = 0
        self.address: Address | None = None
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None

    def prepare(self) -> PeerInfo:
        self._close()  # a failed update may have left one behind
        if self.is_master:
            self._sender = Sender(self.bucket_size, timeout_s=self.timeout_s)
            address = self._sender.listen()
            return PeerInfo(self._sender.device, address)
        return PeerInfo(local_device())

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[PeerInfo]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = metadata[0]
        if master.address is None:
            raise ValueError("actor rank 0 must be the timeslice_ipc sender (is_master)")
        for info in metadata[actor_wg_world_size:actor_wg_world_size + rollout_world_size]:
            check_same_device(master.device, info.device)
        actor = {"role": [Role.SENDER] + [Role.BYSTANDER] * (actor_wg_world_size - 1),
                 "address": [master.address] * actor_wg_world_size,
                 "receivers": [rollout_world_size] * actor_wg_world_size}
        rollout = {"role": [Role.RECEIVER] * rollout_world_size,
                   "address": [master.address] * rollout_world_size,
                   "receivers": [rollout_world_size] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, role: Role, address: Address, receivers: int) -> None:
        self.role, self.address, self.receivers = Role(role), address, int(receivers)
        if self.role is Role.SENDER and self._sender is None:
            raise RuntimeError("timeslice_ipc: the sender was not prepared (prepare() runs before each update)")

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        if self.role is Role.RECEIVER:
            raise RuntimeError("timeslice_ipc: a rollout worker does not send weights")
        if self.role is Role.BYSTANDER:
            async for _ in _each(weights):
                pass
            return {}
        sender = self._sender
        assert sender is not None
        sender.accept(self.receivers)
        sender.begin()
        async for name, tensor in _each(weights):
            sender.add(name, tensor)
        stats = sender.finish()
        log.info("%s: version %s, %d tensors, %d bytes in %.4f s (%d buckets) to %d receiver(s)", BACKEND, global_steps,
                 stats.tensors, stats.bytes, stats.seconds, stats.buckets, stats.receivers)
        return {METRIC_BYTES: float(stats.bytes), METRIC_SECONDS: stats.seconds, METRIC_BUCKETS: float(stats.buckets)}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, Any], None]:
        if self.role is not Role.RECEIVER or self.address is None:
            raise RuntimeError(f"timeslice_ipc: receive_weights on a {self.role} (init_process_group first)")
        self._receiver = Receiver(self.address, timeout_s=self.timeout_s)
        self._receiver.connect()
        for name, tensor in self._receiver.tensors():
            yield name, tensor

    def finalize(self) -> None:
        self._close()

    def _close(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()


async def _each(weights: Any):
    """A sync or async iterable of ``(name, tensor)``, walked asynchronously."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


__all__ = ["PeerInfo", "Role", "TimesliceIPCCheckpointEngine"]
