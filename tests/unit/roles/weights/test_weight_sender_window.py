"""The sender's bucket pipeline (roles/weights/sender.py): up to `transfer.window` buckets in
flight to a rollout, the next one packed meanwhile into the packer's other buffer, and no
buffer repacked before the rollout answered the bucket in it.

The rollout is played by a recording transfer (the network is not what is tested here; the
zmq and nccl paths run against a real vLLM rollout in tests/integration): it answers each
bucket after a delay, in order, and at that moment checks that the buffer still holds what
was packed for that bucket — what a vLLM worker reading a CUDA IPC handle relies on."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import zmq.asyncio

from roles.weights.errors import WeightSyncError
from roles.weights.layout import BucketPacker, PackedBucket, unpack
from roles.weights.sender import ThreadSource, WeightSender
from transport import wire
from transport.endpoint import ChannelOptions, Envelope
from transport.sockets import bind_router

CPU = torch.device("cpu")


def weights(n: int) -> dict[str, torch.Tensor]:
    """`n` tensors of 1 KiB each, every one different."""
    return {f"w{i}": torch.full((256,), float(i)) for i in range(n)}


class Recorder:
    """A transfer that answers each bucket after `delay_s` (in order, like a rollout's
    lock) and checks the buffer's content then; `fail_at`: bucket index it refuses."""

    name = "recorder"

    def __init__(self, window: int, expected: dict[str, torch.Tensor], delay_s: float = 0.02) -> None:
        self.window = window
        self.expected = expected
        self.delay_s = delay_s
        self.fail_at: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}
        self.max_in_flight = 0
        self.order: list[tuple[str, int]] = []
        self.corrupt: list[int] = []
        self.next_was_in_flight: list[bool] = []  # per answered bucket but the last
        self.wait_for_next_s = 0.0
        self._locks: dict[str, asyncio.Lock] = {}
        self._arrived = asyncio.Condition()

    async def prepare(self, target: str, ep: Any) -> None:
        pass

    async def send(self, target: str, ep: Any, version: int, bucket: PackedBucket) -> wire.Message:
        self.in_flight[target] = self.in_flight.get(target, 0) + 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight[target])
        async with self._arrived:
            self._arrived.notify_all()
        try:
            async with self._locks.setdefault(target, asyncio.Lock()):
                await asyncio.sleep(self.delay_s)  # the rollout loading it
                if self.wait_for_next_s and not bucket.last:
                    self.next_was_in_flight.append(await self._next_arrives(target))
                for name, view in unpack(bucket.flat, bucket.slots):
                    if not torch.equal(view, self.expected[name]):
                        self.corrupt.append(bucket.index)
                self.order.append((target, bucket.index))
                if self.fail_at.get(target) == bucket.index:
                    raise WeightSyncError(target, f"bucket {bucket.index}", "refused")
        finally:
            self.in_flight[target] -= 1
        if bucket.last:
            return wire.WeightsApplied(version=version, load_s=0.001, rollout=target)
        return wire.Ack()

    async def _next_arrives(self, target: str) -> bool:
        """Whether the next bucket reaches this target (within `wait_for_next_s`) before
        this one is answered: the rollout then never waits on the trainer between them."""
        async with self._arrived:
            try:
                await asyncio.wait_for(
                    self._arrived.wait_for(lambda: self.in_flight[target] >= 2), self.wait_for_next_s
                )
            except TimeoutError:
                return False
        return True

    async def forget(self, target: str) -> None:
        pass

    async def aclose(self) -> None:
        pass


class _NoEndpoint:
    async def aclose(self) -> None:
        pass


async def push(recorder: Recorder, targets: list[str], tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Any:
    ctx = zmq.asyncio.Context()
    sender = WeightSender(ctx, ChannelOptions(), "trainer", 5.0, recorder)
    sender.targets = {t: _NoEndpoint() for t in targets}  # type: ignore[misc]
    packer = BucketPacker(CPU, bucket_bytes)  # two reused buffers
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            return await sender.push(1, ThreadSource(packer.buckets(iter(tensors.items())), pool))
        finally:
            ctx.destroy(linger=0)


@pytest.mark.parametrize("window", [1, 2])
async def test_buffers_are_never_repacked_before_their_bucket_is_answered(window: int) -> None:
    tensors = weights(12)
    recorder = Recorder(window, tensors)
    result = await push(recorder, ["rollout-0", "rollout-1"], tensors, bucket_bytes=2048)  # 2 tensors a bucket
    assert not result.failed and set(result.applied) == {"rollout-0", "rollout-1"}
    assert recorder.corrupt == []
    assert recorder.max_in_flight == window
    for target in ("rollout-0", "rollout-1"):
        assert [i for t, i in recorder.order if t == target] == list(range(6))
    assert result.num_bytes == sum(t.numel() * 4 for t in tensors.values())


@pytest.mark.parametrize(("window", "wait_s"), [(1, 0.2), (2, 10.0)])
async def test_a_window_of_two_hides_the_round_trip(window: int, wait_s: float) -> None:
    """With two in flight the next bucket has reached the rollout before the one it is
    loading is answered, so the rollout never waits a round trip between buckets; one at a
    time, it never has. Ordering, not wall-clock time (speed is for benchmarks/weight_sync.py):
    each answer waits up to `wait_s` for the next bucket, which with a window of one cannot
    come until the answer is sent."""
    tensors = weights(8)
    recorder = Recorder(window, tensors, delay_s=0.0)
    recorder.wait_for_next_s = wait_s
    result = await push(recorder, ["rollout-0"], tensors, bucket_bytes=1024)  # 8 buckets
    assert not result.failed and recorder.corrupt == []
    assert recorder.next_was_in_flight == [window == 2] * 7


async def test_a_target_failing_mid_update_is_reported_once_and_the_others_finish() -> None:
    tensors = weights(12)
    recorder = Recorder(2, tensors)
    recorder.fail_at["rollout-1"] = 2
    result = await push(recorder, ["rollout-0", "rollout-1"], tensors, bucket_bytes=2048)
    assert set(result.applied) == {"rollout-0"}
    assert set(result.failed) == {"rollout-1"} and result.failed["rollout-1"].phase == "bucket 2"
    assert [i for t, i in recorder.order if t == "rollout-0"] == list(range(6))
    assert max(i for t, i in recorder.order if t == "rollout-1") <= 3  # at most the one already in flight
    assert recorder.corrupt == []


async def test_when_every_target_fails_the_export_is_still_drained() -> None:
    """The export is a collective every trainer rank finishes: the source is pulled to its
    last bucket even when nobody is left to send to."""
    tensors = weights(12)
    recorder = Recorder(2, tensors)
    recorder.fail_at["rollout-0"] = 0
    pulled: list[int] = []
    packer = BucketPacker(CPU, 2048)

    def counted() -> Any:
        for b in packer.buckets(iter(tensors.items())):
            pulled.append(b.index)
            yield b

    ctx = zmq.asyncio.Context()
    sender = WeightSender(ctx, ChannelOptions(), "trainer", 5.0, recorder)
    sender.targets = {"rollout-0": _NoEndpoint()}  # type: ignore[dict-item]
    with ThreadPoolExecutor(max_workers=1) as pool:
        result = await sender.push(1, ThreadSource(counted(), pool))
    ctx.destroy(linger=0)
    assert set(result.failed) == {"rollout-0"} and not result.applied
    assert pulled == list(range(6))


async def test_a_rollout_forgotten_and_listed_again_at_once_answers_the_new_connection() -> None:
    """A rollout's ROUTER refuses (silently) a connection under a routing identity it still
    holds, so each connection the sender makes has its own: reconnecting to a live rollout
    straight after forgetting it (a failed update, then the controller's next peer list)
    must reach it. Real ZeroMQ sockets; with one identity most reconnects were dropped."""
    ctx = zmq.asyncio.Context()
    server = bind_router(ctx, "tcp://127.0.0.1:0", name="rollout-0")

    async def ack(env: Envelope) -> wire.Message:
        return wire.Ack()

    server.start(ack)
    sender = WeightSender(ctx, ChannelOptions(), "trainer-0", 5.0, Recorder(1, {}))
    peer = wire.PeerInfo(role="rollout", rank=0, address=server.address)
    try:
        for _ in range(10):
            assert await sender.set_targets([peer]) == ["rollout-0"]
            reply = await sender.targets["rollout-0"].request(wire.Ack(), timeout=5)
            assert isinstance(reply, wire.Ack)
            assert await sender.set_targets([]) == [] and sender.targets == {}
    finally:
        await sender.aclose()
        await server.aclose()
        ctx.destroy(linger=0)
