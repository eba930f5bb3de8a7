"""The one tensor layout every weight-sync backend shares: named tensors of a bucket laid
out in one flat uint8 buffer (`wire.TensorSlot` says where each lies).

What a caller may rely on:
* `layout(tensors, index)` puts every tensor at an ALIGN-byte boundary, in order, without
  overlap; `pack_into` then copies the tensors into a buffer of at least that size on
  any device (a GPU buffer is filled by GPU copies: nothing passes through the CPU) and
  `unpack` returns named views into a buffer (no copies).
* `BucketPacker.buckets(items)` groups a stream of named tensors into buckets of at most
  `bucket_bytes` (a tensor larger than that gets a bucket of its own) and packs each into
  one of `num_buffers` reusable buffers, round robin. A buffer is reused `num_buffers`
  buckets later, so a consumer must be done with bucket k before it asks for bucket
  k + num_buffers; memory stays at `num_buffers` × the largest bucket however many
  updates run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from transport.wire import TensorSlot

ALIGN = 256  # byte alignment of every tensor in a bucket (any dtype view, coalesced copies)
NUM_BUFFERS = 2  # BucketPacker's default: bucket k's buffer is repacked for bucket k + 2


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layout(tensors: Mapping[str, torch.Tensor], index: int = 0) -> tuple[list[TensorSlot], int]:
    """The slots of bucket `index` and the buffer size they need."""
    slots: list[TensorSlot] = []
    offset = 0
    for name, t in tensors.items():
        size = nbytes_of(t)
        slots.append(TensorSlot(name, str(t.dtype).removeprefix("torch."), list(t.shape), index, offset, size))
        offset += -(-size // ALIGN) * ALIGN
    return slots, offset


def pack_into(tensors: Mapping[str, torch.Tensor], slots: Sequence[TensorSlot], out: torch.Tensor) -> torch.Tensor:
    """Copy `tensors` into the flat uint8 `out` as `slots` say; returns `out`."""
    for s in slots:
        if s.nbytes:
            src = tensors[s.name].contiguous().reshape(-1).view(torch.uint8)
            out[s.offset : s.offset + s.nbytes].copy_(src, non_blocking=True)
    return out


def pack(
    tensors: Mapping[str, torch.Tensor], device: torch.device, index: int = 0
) -> tuple[list[TensorSlot], torch.Tensor]:
    """One bucket as a new flat buffer on `device`, and its slots."""
    slots, size = layout(tensors, index)
    return slots, pack_into(tensors, slots, torch.empty(size, dtype=torch.uint8, device=device))


def unpack(flat: torch.Tensor, slots: Sequence[TensorSlot]) -> list[tuple[str, torch.Tensor]]:
    """Named views into a packed buffer (no copies)."""
    return [(s.name, flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)) for s in slots]


def bucketed(items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group named tensors into dicts of at most `bucket_bytes` (one tensor may exceed it)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in items:
        if bucket and size + nbytes_of(t) > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes_of(t)
    if bucket:
        yield bucket


@dataclass
class PackedBucket:
    index: int
    last: bool
    slots: list[TensorSlot]
    flat: torch.Tensor  # uint8 view of one of the packer's buffers, exactly the bucket's size
    buffer: int  # which of the packer's buffers holds it
    gather_s: float  # time spent producing the tensors (the export's gathers and casts) and packing

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


class BucketPacker:
    def __init__(self, device: torch.device, bucket_bytes: int, num_buffers: int = NUM_BUFFERS) -> None:
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.buffers: list[torch.Tensor | None] = [None] * num_buffers

    def buckets(self, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[PackedBucket]:
        """The packed buckets of `items` (see the module docstring for buffer reuse)."""
        started = time.perf_counter()
        groups = bucketed(items, self.bucket_bytes)
        current = next(groups, None)
        index = 0
        while current is not None:
            following = next(groups, None)  # gathers the next bucket's tensors (see BucketPacker docs)
            slots, size = layout(current, index)
            which = index % len(self.buffers)
            flat = pack_into(current, slots, self._buffer(which, size))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # readers use other streams or processes
            yield PackedBucket(index, following is None, slots, flat, which, time.perf_counter() - started)
            current, index = following, index + 1
            started = time.perf_counter()

    def _buffer(self, which: int, size: int) -> torch.Tensor:
        buf = self.buffers[which]
        if buf is None or buf.numel() < size:
            buf = self.buffers[which] = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8, device=self.device)
        return buf[:size]
