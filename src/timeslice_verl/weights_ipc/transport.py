"""Same-GPU weight transfer over CUDA IPC: a sender's two GPU buckets, opened by its receivers in place.

Per update: the sender listens (:meth:`Sender.listen`), each receiver connects and names its device
(:class:`Hello`), the sender refuses one on another GPU (:func:`~.devices.check_same_device`) and hands the others
the IPC handles of its two buckets (:class:`Handles`). Then the sender fills one bucket while the receivers read the
other: it copies tensors in, waits for the copies (``torch.cuda.synchronize``), sends a :class:`~.layout.Bucket`,
and before refilling a bucket waits for every receiver's :class:`Ack` of it. A receiver yields views of the bucket
(merging chunks of tensors larger than a bucket into tensors of its own), and acknowledges once the consumer asked
for the next tensor and the GPU finished the consumer's copies. At the end each receiver drops every reference to
the buckets, which closes the IPC mappings, and says so (:class:`Released`); only then does the sender free them.
Nothing outlives an update: no growth over any number of them.

torch is imported lazily, so the layout and the checks import without it (and none of this needs verl).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from timeslice_verl.log import get_logger
from timeslice_verl.weights import WeightsError
from timeslice_verl.weights_ipc import channel
from timeslice_verl.weights_ipc.channel import Address, ChannelError, Refusal
from timeslice_verl.weights_ipc.devices import DeviceIdentity, DeviceMismatch, check_same_device, local_device
from timeslice_verl.weights_ipc.layout import Bucket, Packer, Piece

log = get_logger("weights_ipc")

TIMEOUT_S = 600.0
"""The longest one side waits for the other (a connection, a bucket, an acknowledgement)."""
SLOTS = 2


@dataclass(frozen=True)
class Hello:
    """Receiver → sender, first: the receiver's device."""

    device: DeviceIdentity


@dataclass(frozen=True)
class Handles:
    """Sender → receiver: its device and the IPC handles of its buckets (``torch``'s ``reduce_tensor`` args)."""

    device: DeviceIdentity
    bucket_bytes: int
    handles: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class Ack:
    """Receiver → sender: bucket ``seq`` was consumed; its slot may be refilled."""

    seq: int


@dataclass(frozen=True)
class Released:
    """Receiver → sender, at its close: it holds no reference to the buckets (``still_open``: a consumer kept a
    view, so the mapping stays open until that view dies)."""

    still_open: bool


@dataclass
class PushStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    receivers: int = 0
    stalls: list[float] = field(default_factory=list)


@contextlib.contextmanager
def _plain_segments(torch: Any) -> Iterator[None]:
    """Allocate outside expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which verl
    sets at times): their memory is shared by file descriptor, which a receiver may not be allowed to take; a plain
    segment's legacy IPC handle opens in any process of this user."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if put is None:
        put = torch.cuda.memory._set_allocator_settings
    settings = get() if get is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                            os.environ.get("PYTORCH_ALLOC_CONF", ""))
    expandable = "expandable_segments:true" in settings.replace(" ", "").lower()
    if expandable:
        put("expandable_segments:False")
    try:
        yield
    finally:
        if expandable:
            put("expandable_segments:True")


def _on_device(args: tuple[Any, ...], index: int) -> tuple[Any, ...]:
    """``reduce_tensor``'s arguments with the storage's device (position 6, the sender's index) replaced by this
    process's index of the same GPU (checked by UUID): the two processes may number it differently."""
    out = list(args)
    if not isinstance(out[6], int):
        raise WeightsError(f"unexpected CUDA IPC handle layout from this torch: {type(out[6]).__name__} at 6")
    out[6] = index
    return tuple(out)


class Sender:
    """The trainer's side: one per update (listen → accept → push → close)."""

    def __init__(self, bucket_bytes: int, *, timeout_s: float = TIMEOUT_S, device: DeviceIdentity | None = None) -> None:
        Packer(bucket_bytes)  # refuse a bad size before anything is allocated
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.device = device
        """This process's GPU (default: torch's current device, at :meth:`listen`)."""
        self._listener: channel.Listener | None = None
        self._conns: list[socket.socket] = []
        self._buckets: list[Any] = []

    def listen(self) -> Address:
        if self.device is None:
            self.device = local_device()
        self._listener = channel.Listener()
        return self._listener.address

    def accept(self, receivers: int) -> None:
        """Take ``receivers`` connections, refuse any on another GPU (before allocating anything), then hand out
        the buckets' handles."""
        assert self._listener is not None and self.device is not None, "listen() first"
        for _ in range(receivers):
            conn = self._listener.accept(self.timeout_s)
            self._conns.append(conn)
            hello = channel.receive(conn, self.timeout_s, "receiver's device", Hello)
            try:
                check_same_device(self.device, hello.device)
            except DeviceMismatch as exc:
                channel.send(conn, Refusal(str(exc)))
                raise
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        with _plain_segments(torch):
            self._buckets = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=f"cuda:{self.device.index}")
                             for _ in range(SLOTS)]
        for conn in self._conns:  # one export per receiver: torch counts each opener once
            handles = tuple(reduce_tensor(b)[1] for b in self._buckets)
            channel.send(conn, Handles(self.device, self.bucket_bytes, handles))

    def push(self, named: Iterable[tuple[str, Any]]) -> PushStats:
        """Send every tensor of ``named`` (CUDA tensors of this device) and wait for the last acknowledgements."""
        self.begin()
        for name, tensor in named:
            self.add(name, tensor)
        return self.finish()

    def begin(self) -> None:
        self._packer = Packer(self.bucket_bytes)
        self._slot, self._seq, self._pieces = 0, 0, []
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        self.stats = PushStats(receivers=len(self._conns))
        self._t0 = time.perf_counter()

    def add(self, name: str, tensor: Any) -> None:
        import torch

        if not tensor.is_cuda or tensor.device.index != self.device.index:
            raise WeightsError(f"tensor {name!r} is on {tensor.device}, not on cuda:{self.device.index}")
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        dtype = str(tensor.dtype).removeprefix("torch.")
        for placement in self._packer.place(name, dtype, tuple(tensor.shape), flat.numel()):
            if placement.flush_before:
                self._flush(last=False)
            piece = placement.piece
            self._claim(self._slot)
            dst = self._buckets[self._slot][piece.offset:piece.offset + piece.chunk_size]
            dst.copy_(flat[piece.chunk_offset:piece.chunk_offset + piece.chunk_size])
            self._pieces.append(piece)
        self.stats.tensors += 1
        self.stats.bytes += flat.numel()

    def finish(self) -> PushStats:
        self._flush(last=True)
        while self._pending:
            self._await_oldest()
        self.stats.seconds = time.perf_counter() - self._t0
        return self.stats

    def _claim(self, slot: int) -> None:
        """Wait until no receiver still reads ``slot``."""
        while any(s == slot for s, _ in self._pending):
            t0 = time.perf_counter()
            self._await_oldest()
            self.stats.stalls.append(time.perf_counter() - t0)

    def _await_oldest(self) -> None:
        _, seq = self._pending.popleft()
        for conn in self._conns:
            ack = channel.receive(conn, self.timeout_s, f"acknowledgement of bucket {seq}", Ack)
            if ack.seq != seq:
                raise ChannelError(f"a receiver acknowledged bucket {ack.seq} while bucket {seq} was due")

    def _flush(self, *, last: bool) -> None:
        import torch

        self._claim(self._slot)
        torch.cuda.synchronize(self.device.index)  # the copies land before a receiver reads the bucket
        length = max((p.offset + p.chunk_size for p in self._pieces), default=0)
        message = Bucket(self._seq, self._slot, length, tuple(self._pieces), last)
        for conn in self._conns:
            channel.send(conn, message)
        self._pending.append((self._slot, self._seq))
        self.stats.buckets += 1
        self._seq += 1
        self._slot = (self._slot + 1) % SLOTS
        self._pieces = []

    def close(self) -> bool:
        """Wait for each receiver's release, free the buckets and the socket. False: a receiver kept a mapping
        open or never said (its memory is then freed by torch once that mapping dies)."""
        import torch

        clean = True
        handed_out = bool(self._buckets)
        for conn in self._conns:
            if not handed_out:  # refused, or failed before the handles went out: nothing to wait for
                conn.close()
                continue
            try:
                released = channel.receive(conn, self.timeout_s, "release of the buckets", Released)
                clean = clean and not released.still_open
            except ChannelError as exc:
                log.warning("a receiver did not confirm it closed the buckets: %s", exc)
                clean = False
            conn.close()
        self._conns = []
        self._buckets = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return clean


class Receiver:
    """The rollout's side: one per update (connect → tensors → close)."""

    def __init__(self, address: Address, *, timeout_s: float = TIMEOUT_S, device: DeviceIdentity | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.device = device
        """This process's GPU (default: torch's current device, at :meth:`connect`)."""
        self._sock: socket.socket | None = None
        self._buckets: list[Any] = []
        self._refs: list[Any] = []

    def connect(self) -> DeviceIdentity:
        """Join the sender; raise :class:`DeviceMismatch` (both devices named) when it is on another GPU."""
        mine = self.device if self.device is not None else local_device()
        self._sock = channel.connect(self.address, self.timeout_s)
        channel.send(self._sock, Hello(mine))
        try:
            reply = channel.receive(self._sock, self.timeout_s, "bucket handles", Handles)
        except ChannelError as exc:
            self._sock.close()
            self._sock = None
            if "same-GPU CUDA IPC weight transfer refused" in str(exc):
                raise DeviceMismatch(str(exc).removeprefix("the peer refused: ")) from None
            raise
        check_same_device(reply.device, mine)
        from torch.multiprocessing.reductions import StorageWeakRef, rebuild_cuda_tensor

        self._buckets = [rebuild_cuda_tensor(*_on_device(args, mine.index)) for args in reply.handles]
        self._refs = [StorageWeakRef(b.untyped_storage()) for b in self._buckets]
        return reply.device

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """``(name, tensor)`` for every tensor pushed: views of a bucket, valid until the next is asked for."""
        import torch

        assert self._sock is not None, "connect() first"
        merging: dict[str, Any] = {}
        device = self._buckets[0].device
        while True:
            bucket = channel.receive(self._sock, self.timeout_s, "next bucket", Bucket)
            data = self._buckets[bucket.slot]
            for piece in bucket.pieces:
                done = self._take(piece, data, merging, torch)
                if done is not None:
                    yield piece.name, done
                    done = None
            data = None
            torch.cuda.synchronize(device)  # the consumer's copies out of the bucket are done
            channel.send(self._sock, Ack(bucket.seq))
            if bucket.last:
                if merging:
                    raise WeightsError(f"the push ended inside tensor(s) {sorted(merging)}")
                return

    @staticmethod
    def _take(piece: Piece, data: Any, merging: dict[str, Any], torch: Any) -> Any:
        src = data[piece.offset:piece.offset + piece.chunk_size]
        dtype = getattr(torch, piece.dtype)
        if piece.whole:
            return src.view(dtype).view(piece.shape)
        if piece.chunk_offset == 0:
            merging[piece.name] = torch.empty(piece.shape, dtype=dtype, device=data.device)
        whole = merging[piece.name]
        whole.view(-1).view(torch.uint8)[piece.chunk_offset:piece.chunk_offset + piece.chunk_size].copy_(src)
        if piece.ends:
            return merging.pop(piece.name)
        return None

    def close(self) -> bool:
        """Drop the buckets (closing the IPC mappings) and tell the sender. False: a consumer still holds a view."""
        import torch

        self._buckets = []
        gc.collect()
        still_open = any(not ref.expired() for ref in self._refs)
        self._refs = []
        if still_open:
            log.warning("a consumer still holds a view of the sender's bucket: its mapping stays open until it dies")
        if self._sock is not None:
            try:
                channel.send(self._sock, Released(still_open))
            except ChannelError as exc:
                log.warning("could not tell the sender the buckets are released: %s", exc)
            self._sock.close()
            self._sock = None
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return not still_open


__all__ = ["Ack", "Handles", "Hello", "PushStats", "Receiver", "Released", "Sender", "TIMEOUT_S"]
