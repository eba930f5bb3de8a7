"""The rollout's weight receiver (roles/weights/receiver.py) against forged weight
messages, with a fake engine: a checksum request without the run's token is refused; an
update with a valid token whose version jumps past the run's last version (NaN weights at
version 1e6) is refused before any work, over both the staged (zmq) and the bucket-by-bucket
(ipc/nccl) paths, and so is any jump past the next version outside the one sync of a rollout
that registered behind the trainer; the legitimate next version, a resume's and a late
joiner's jump are taken; thousands of forgeries cost a handful of log lines."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog
import torch

from roles.weights.receiver import WeightReceiver
from transport import wire
from transport.throttle import Throttled

TOKEN = "ab" * 32
LAST = 20  # trainer.total_steps


class FakeEngine:
    def __init__(self, version: int) -> None:
        self.version = version
        self.updating: int | None = None
        self.applied: list[int] = []

    async def checksums(self) -> dict[str, float]:
        return {"w": 1.0}

    async def apply_weights(self, version: int, manifest: dict[str, Any], timeout_s: float) -> dict[str, float]:
        self.applied.append(version)
        self.version = version
        return {"load_s": 0.0, "total_s": 0.0, "pause_s": 0.0}

    async def begin_update(self, version: int, timeout_s: float) -> float:
        raise AssertionError("a refused update must not pause the engine")


def receiver(version: int = 3) -> tuple[WeightReceiver, FakeEngine]:
    engine = FakeEngine(version)

    async def applied(msg: wire.WeightsApplied, pause_s: float) -> None:
        pass

    rx = WeightReceiver(engine, "rollout-0", local_host="127.0.0.1", timeout_s=5.0, token=TOKEN,  # type: ignore[arg-type]
                        on_applied=applied, max_version=LAST)  # fmt: skip
    return rx, engine


def bucket(version: int, token: str = TOKEN, value: float = 1.0) -> wire.WeightBucket:
    return wire.WeightBucket(version=version, index=0, last=True, tensors={"w": torch.full((4,), value)}, token=token)


def test_checksums_need_the_token() -> None:
    rx, _ = receiver()
    refused = asyncio.run(rx.handle(wire.WeightChecksums()))
    assert isinstance(refused, wire.Error) and refused.code == wire.ErrorCode.REFUSED and rx.refused == 1
    answered = asyncio.run(rx.handle(wire.WeightChecksums(token=TOKEN)))
    assert isinstance(answered, wire.WeightChecksums) and answered.version == 3 and answered.sums == {"w": 1.0}
    assert answered.token == ""


def test_a_forged_update_with_a_valid_token_and_a_version_jump_is_refused() -> None:
    rx, engine = receiver()
    reply = asyncio.run(rx.handle(bucket(1_000_000, value=float("nan"))))
    assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.REFUSED
    assert "the run's last is 20" in reply.message and engine.applied == [] and engine.version == 3
    meta = wire.WeightBucketMeta(version=LAST + 1, index=0, last=False, slots=[], nbytes=0, token=TOKEN)
    reply = asyncio.run(rx.handle(meta))  # begin_update would raise: refused before it
    assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.REFUSED


@pytest.mark.parametrize(
    ("start", "trainer", "version"), [(3, 3, 4), (0, 0, 0), (0, 17, 17), (0, 17, 18), (12, LAST, LAST)]
)
def test_the_next_a_resumed_and_a_late_joiners_version_are_taken(start: int, trainer: int, version: int) -> None:
    """The next version (or the same again) is taken; a rollout that registered behind the
    trainer (a late joiner, one resumed without weights) is synced to its version, or one
    that steps made meanwhile."""
    rx, engine = receiver(start)
    rx.expect_sync(trainer)
    reply = asyncio.run(rx.handle(bucket(version)))
    assert isinstance(reply, wire.WeightsApplied) and engine.applied == [version]


def test_a_version_jump_with_a_valid_token_is_refused_outside_a_sync() -> None:
    """A token holder may not skip versions: the trainer publishes each one to every rollout,
    so anything but the next is a forgery (it would make the rollout refuse every later one)."""
    rx, engine = receiver(3)
    rx.expect_sync(3)  # registered level with the trainer: no sync pending
    for version in (5, LAST):
        reply = asyncio.run(rx.handle(bucket(version)))
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.REFUSED
        assert "takes only 4 next" in reply.message
    meta = wire.WeightBucketMeta(version=6, index=0, last=False, slots=[], nbytes=0, token=TOKEN)
    reply = asyncio.run(rx.handle(meta))  # begin_update would raise: refused before it
    assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.REFUSED
    assert engine.applied == [] and engine.version == 3


def test_a_sync_allows_one_jump_then_only_the_next() -> None:
    rx, engine = receiver(0)
    rx.expect_sync(9)
    assert isinstance(asyncio.run(rx.handle(bucket(4))), wire.Error)  # below the trainer's version: not the sync
    assert isinstance(asyncio.run(rx.handle(bucket(9))), wire.WeightsApplied)
    assert isinstance(asyncio.run(rx.handle(bucket(12))), wire.Error)
    assert isinstance(asyncio.run(rx.handle(bucket(10))), wire.WeightsApplied)
    assert engine.applied == [9, 10]


def test_five_thousand_forgeries_cost_a_handful_of_log_lines() -> None:
    rx, _ = receiver()
    with structlog.testing.capture_logs() as lines:
        for i in range(5000):
            forged = [wire.WeightChecksums(), bucket(10**6), bucket(2), bucket(4, token="0" * 64)][i % 4]
            assert isinstance(asyncio.run(rx.handle(forged)), wire.Error)
        noisy = Throttled(structlog.get_logger("controller"))
        for i in range(5000):
            noisy.warning(["completion_ignored", "unexpected_message"][i % 2], peer="fuzzer")
    warnings = [line for line in lines if line["log_level"] == "warning"]
    assert len(warnings) <= 50, len(warnings)
    summary = [w for w in warnings if w.get("summary") and w["event"] == "weights_refused"]
    assert (summary[-1]["count"], summary[-1]["unlogged"]) == (1000, 997)
