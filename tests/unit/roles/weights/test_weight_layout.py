"""The flat bucket layout every weight-sync backend shares: layout, pack, unpack, and the
packer's bucketing and buffer reuse (what the GPU paths do on the GPU, here on the CPU)."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from roles.weights.group import describe
from roles.weights.layout import ALIGN, BucketPacker, bucketed, layout, pack, unpack
from transport import wire

CPU = torch.device("cpu")


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(7, 5, generator=gen).bfloat16(),
        "norm": torch.randn(5, generator=gen),
        "step": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "transposed": torch.randn(4, 6, generator=gen).t(),  # not contiguous
    }


def test_slots_are_aligned_disjoint_and_in_order() -> None:
    tensors = sample_tensors()
    slots, size = layout(tensors, index=3)
    assert [s.name for s in slots] == list(tensors)
    assert size % ALIGN == 0 and all(s.bucket == 3 for s in slots)
    for s in slots:
        assert s.offset % ALIGN == 0 and s.offset + s.nbytes <= size
    for a, b in itertools.pairwise(slots):
        assert a.offset + a.nbytes <= b.offset
    assert (slots[0].dtype, slots[0].shape, slots[0].nbytes) == ("bfloat16", [7, 5], 70)


def test_pack_then_unpack_is_exact() -> None:
    tensors = sample_tensors()
    slots, flat = pack(tensors, CPU)
    assert flat.dtype == torch.uint8 and flat.numel() == layout(tensors)[1]
    got = dict(unpack(flat, slots))
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t), name


def test_unpack_returns_views_of_the_buffer() -> None:
    slots, flat = pack({"w": torch.arange(6, dtype=torch.float32)}, CPU)
    ((_, view),) = unpack(flat, slots)
    flat[: view.element_size()] = 0
    assert view[0].item() == 0.0 and view.data_ptr() == flat.data_ptr()


def test_bucketing_keeps_order_and_gives_a_big_tensor_its_own_bucket() -> None:
    items = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("big", torch.zeros(100)), ("c", torch.zeros(5))]
    assert [list(b) for b in bucketed(iter(items), 80)] == [["a", "b"], ["big"], ["c"]]
    assert list(bucketed(iter([]), 80)) == []


def test_packer_streams_buckets_into_two_reused_buffers() -> None:
    items = [(f"w{i}", torch.full((16,), float(i))) for i in range(7)]  # 64 bytes each
    packer = BucketPacker(CPU, bucket_bytes=128)
    seen = []
    for b in packer.buckets(iter(items)):
        names = [s.name for s in b.slots]
        for name, view in unpack(b.flat, b.slots):
            assert torch.equal(view, dict(items)[name]), name  # valid until two buckets later
        seen.append((b.index, b.last, b.buffer, names, b.flat.data_ptr()))
    assert [s[:4] for s in seen] == [
        (0, False, 0, ["w0", "w1"]), (1, False, 1, ["w2", "w3"]), (2, False, 0, ["w4", "w5"]), (3, True, 1, ["w6"]),
    ]  # fmt: skip
    assert seen[0][4] == seen[2][4] and seen[1][4] == seen[3][4] and seen[0][4] != seen[1][4]
    # A second update reuses the same memory: nothing grows with the number of updates.
    ptrs = [b.flat.data_ptr() for b in packer.buckets(iter(items))]
    assert ptrs == [s[4] for s in seen]


def test_packer_grows_a_buffer_for_a_tensor_larger_than_a_bucket() -> None:
    packer = BucketPacker(CPU, bucket_bytes=64)
    (b,) = packer.buckets(iter([("big", torch.arange(100, dtype=torch.float32))]))
    assert b.last and torch.equal(dict(unpack(b.flat, b.slots))["big"], torch.arange(100, dtype=torch.float32))


def test_bucket_meta_survives_the_wire_and_builtins() -> None:
    """A bucket's meta goes over zmq to the rollout, then as builtins through vLLM's RPC."""
    slots, flat = pack(sample_tensors(), CPU)
    handle = wire.IpcHandle("GPU-1234", b"\x00\x01handle", 4096, 512, 0, 2048, b"rc", 8, b"ev", True)
    meta = wire.WeightBucketMeta(version=4, index=2, last=True, slots=slots, nbytes=flat.numel(), ipc=handle)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=wire.Message) == meta
    assert msgspec.convert(msgspec.to_builtins(meta.ipc), wire.IpcHandle) == handle
    assert msgspec.convert(msgspec.to_builtins(meta.slots), list[wire.TensorSlot]) == slots


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            RuntimeError(
                "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                "[127.0.0.1]:2281. This is typically caused by a remote worker hanging."
            ),
            "RuntimeError: Connection closed by peer [127.0.0.1]:2281.",
        ),
        (TimeoutError(), "TimeoutError"),
    ],
)
def test_causes_are_one_line_without_source_paths(exc: BaseException, expected: str) -> None:
    assert describe(exc) == expected
