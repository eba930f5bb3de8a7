"""The flat bucket layout of the collective weight-sync backend: plan, pack, unpack."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from transport import wire
from transport.collective import ALIGN, bucket_slots, describe, pack, plan_slots, unpack

CPU = torch.device("cpu")


def sample_buckets() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "embed": torch.randn(7, 5, generator=gen).bfloat16(),
            "norm": torch.randn(5, generator=gen),
            "step": torch.tensor(3, dtype=torch.int64),
        },
        {"empty": torch.empty(0, 4, dtype=torch.float16), "mask": torch.tensor([True, False, True])},
        {"transposed": torch.randn(4, 6, generator=gen).t()},  # not contiguous
    ]


def test_slots_are_aligned_and_disjoint() -> None:
    buckets = sample_buckets()
    slots, sizes = plan_slots(buckets)
    assert [s.name for s in slots] == [n for b in buckets for n in b]
    assert len(sizes) == len(buckets)
    for i, size in enumerate(sizes):
        mine = bucket_slots(slots, i)
        assert size % ALIGN == 0
        for s in mine:
            assert s.offset % ALIGN == 0 and s.offset + s.nbytes <= size
        for a, b in itertools.pairwise(mine):
            assert a.offset + a.nbytes <= b.offset
    embed = slots[0]
    assert (embed.dtype, embed.shape, embed.nbytes) == ("bfloat16", [7, 5], 70)


def test_pack_then_unpack_is_exact() -> None:
    buckets = sample_buckets()
    slots, sizes = plan_slots(buckets)
    for i, bucket in enumerate(buckets):
        flat = pack(bucket, bucket_slots(slots, i), sizes[i], CPU)
        assert flat.dtype == torch.uint8 and flat.numel() == sizes[i]
        got = dict(unpack(flat, bucket_slots(slots, i)))
        assert list(got) == list(bucket)
        for name, t in bucket.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], t), name


def test_unpack_returns_views_of_the_buffer() -> None:
    bucket = {"w": torch.arange(6, dtype=torch.float32)}
    slots, sizes = plan_slots([bucket])
    flat = pack(bucket, slots, sizes[0], CPU)
    ((_, view),) = unpack(flat, slots)
    flat[: view.element_size()] = 0
    assert view[0].item() == 0.0 and view.data_ptr() == flat.data_ptr()


def test_no_buckets_no_slots() -> None:
    assert plan_slots([]) == ([], [])


def test_plan_survives_the_wire_and_builtins() -> None:
    """The plan goes over zmq to the rollout, then as builtins through vLLM's RPC."""
    slots, sizes = plan_slots(sample_buckets())
    plan = wire.WeightCollectivePlan(version=4, slots=slots, bucket_sizes=sizes)
    assert msgspec.convert(msgspec.to_builtins(plan), wire.WeightCollectivePlan) == plan
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=wire.Message) == plan


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
