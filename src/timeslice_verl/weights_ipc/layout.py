"""Where each tensor's bytes go in a fixed-size GPU bucket, and the messages that say so (no torch).

A tensor that fits a bucket travels whole (the receiver hands a view of the bucket on, no copy); a tensor that
fits the bucket but not what is left of it starts the next bucket; one larger than a bucket is cut into chunks
that fill buckets in order (the receiver merges them into one tensor of its own). Offsets are aligned so every
view is aligned for any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from timeslice_verl.weights import WeightsError

ALIGN = 256
"""Byte alignment of each tensor in a bucket (CUDA's allocation granularity for kernels' vector loads)."""


class LayoutError(WeightsError):
    """A bucket size or tensor description that cannot be laid out; the message names it."""


@dataclass(frozen=True)
class Piece:
    """One tensor's bytes, or one chunk of them, at ``offset`` in a bucket."""

    name: str
    dtype: str
    """torch's dtype name without ``torch.`` (``bfloat16``)."""
    shape: tuple[int, ...]
    nbytes: int
    """The whole tensor's size."""
    offset: int
    chunk_offset: int
    chunk_size: int

    @property
    def whole(self) -> bool:
        return self.chunk_offset == 0 and self.chunk_size == self.nbytes

    @property
    def ends(self) -> bool:
        """The tensor's last chunk (or the whole tensor)."""
        return self.chunk_offset + self.chunk_size == self.nbytes


@dataclass(frozen=True)
class Placement:
    """A piece, and whether the current bucket must be sent (and a fresh one started) before it is copied."""

    piece: Piece
    flush_before: bool


@dataclass(frozen=True)
class Bucket:
    """Sender → receiver: bucket ``slot`` holds ``pieces`` in its first ``length`` bytes; ``last`` ends the push."""

    seq: int
    slot: int
    length: int
    pieces: tuple[Piece, ...]
    last: bool


def align_up(value: int, align: int = ALIGN) -> int:
    return (value + align - 1) // align * align


class Packer:
    """Lays tensors out in buckets of ``capacity`` bytes, in the order given (pure bookkeeping)."""

    def __init__(self, capacity: int, *, align: int = ALIGN) -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise LayoutError(f"bucket size must be a positive number of bytes, got {capacity!r}")
        if align <= 0 or align & (align - 1):
            raise LayoutError(f"alignment must be a power of two, got {align!r}")
        if capacity % align:
            raise LayoutError(f"bucket size {capacity} is not a multiple of the alignment {align}")
        self.capacity = capacity
        self.align = align
        self.fill = 0
        """Bytes used in the current bucket."""

    def place(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> list[Placement]:
        """The pieces of one tensor, in order; ``flush_before`` on a piece means: send the current bucket first."""
        if nbytes < 0:
            raise LayoutError(f"tensor {name!r} has a negative size {nbytes}")
        shape = tuple(int(d) for d in shape)
        start = align_up(self.fill, self.align)
        if start + nbytes <= self.capacity:
            self.fill = start + nbytes
            return [Placement(Piece(name, dtype, shape, nbytes, start, 0, nbytes), False)]
        if nbytes <= self.capacity:
            self.fill = nbytes
            return [Placement(Piece(name, dtype, shape, nbytes, 0, 0, nbytes), True)]
        out: list[Placement] = []
        flush, done = start >= self.capacity, 0
        if flush:
            start = 0
        while done < nbytes:
            size = min(self.capacity - start, nbytes - done)
            out.append(Placement(Piece(name, dtype, shape, nbytes, start, done, size), flush))
            done += size
            start += size
            flush = done < nbytes
            if flush:
                start = 0
        self.fill = start
        return out


__all__ = ["ALIGN", "Bucket", "LayoutError", "Packer", "Piece", "Placement", "align_up"]
