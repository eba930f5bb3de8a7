"""The rollout role as a real process, driven over its real ZeroMQ channels."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
import torch
import zmq
import zmq.asyncio

from runtime.config.load import load_config
from runtime.identity.run_token import read_token
from tests.helpers.harness import RoleHarness
from transport import wire
from transport.rpc import RemoteError, RpcEndpoint

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RoleHarness]:
    run_dir = tmp_path_factory.mktemp("rollout-role")
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run_dir}"])
    harness = RoleHarness(cfg, "rollout")
    await harness.start()
    yield harness
    await harness.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def weights(rollout: RoleHarness) -> AsyncIterator[RpcEndpoint]:
    assert rollout.peer is not None
    ep = rollout.connect(rollout.peer.address, name="trainer-0")
    yield ep
    await ep.aclose()


def generate(request_id: str, n: int, max_tokens: int) -> wire.Generate:
    spec = wire.SamplingSpec(n=n, max_tokens=max_tokens, ignore_eos=True)
    return wire.Generate(request_id=request_id, group_id=hash(request_id) % 1000, prompt_ids=[5, 6, 7], sampling=spec)


async def completions(h: RoleHarness, count: int) -> list[wire.Completion]:
    return [await h.next(wire.Completion) for _ in range(count)]


def model_tensors(h: RoleHarness, scale: float) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        k: (v.float() * scale).to(v.dtype)
        for k, v in load_file(Path(h.cfg.run_dir) / "model" / "model.safetensors").items()
    }


async def push(ep: RpcEndpoint, version: int, tensors: dict[str, torch.Tensor], token: str) -> list[wire.Message]:
    names = list(tensors)
    chunks = [names[i : i + 8] for i in range(0, len(names), 8)]
    replies = []
    for i, chunk in enumerate(chunks):
        msg = wire.WeightBucket(
            version=version, index=i, last=i == len(chunks) - 1, tensors={k: tensors[k] for k in chunk}, token=token
        )
        replies.append(await ep.request(msg, timeout=60))
    return replies


async def test_completions_stream_back_per_sample(rollout: RoleHarness) -> None:
    await rollout.send(generate("long", 1, 200))
    await rollout.send(generate("short", 4, 4))
    got = await completions(rollout, 5)
    assert [c.request_id for c in got[:4]] == ["short"] * 4, "short samples must not wait for the long one"
    assert sorted(c.sample_index for c in got[:4]) == [0, 1, 2, 3]
    assert got[4].request_id == "long" and got[4].token_ids.numel() == 200
    for c in got:
        assert c.token_ids.numel() == c.logprobs.numel() == c.versions.numel()
        assert c.finish_reason == wire.FinishReason.LENGTH and c.error == ""
        assert bool((c.versions == 0).all()) and bool(torch.isfinite(c.logprobs).all())


async def test_weight_update_in_place_over_the_channel(rollout: RoleHarness, weights: RpcEndpoint) -> None:
    start = time.perf_counter()
    replies = await push(weights, 1, model_tensors(rollout, 0.5), read_token(rollout.cfg.run_dir))
    elapsed = time.perf_counter() - start
    assert all(isinstance(r, wire.Ack) for r in replies[:-1])
    applied = replies[-1]
    assert isinstance(applied, wire.WeightsApplied) and applied.version == 1 and applied.num_tensors > 0
    assert elapsed < 5.0
    told = await rollout.next(wire.WeightsApplied)
    assert told.version == 1
    await rollout.send(generate("after", 2, 6))
    for c in await completions(rollout, 2):
        assert c.versions.tolist() == [1] * 6


async def test_older_update_is_refused(rollout: RoleHarness, weights: RpcEndpoint) -> None:
    with pytest.raises(RemoteError, match="refused") as info:
        await push(weights, 0, model_tensors(rollout, 1.0), read_token(rollout.cfg.run_dir))
    assert info.value.code == wire.ErrorCode.REFUSED


async def test_sleep_before_step_is_answered_and_a_rollout_without_sleep_mode_stays_awake(rollout: RoleHarness) -> None:
    """A CPU rollout (no vLLM sleep mode, no trainer on its GPU) tells the controller it does
    not sleep, and answers a `SleepBeforeStep` at once without touching the engine; generation goes on."""
    assert rollout.peer is not None and rollout.peer.capabilities["sleeps"] == 0
    reply = await rollout.request(wire.SleepBeforeStep(version=1), timeout=10)
    assert isinstance(reply, wire.Ack) and reply.info == "awake: this rollout does not sleep"
    await rollout.send(generate("after-sleep-request", 1, 3))
    (c,) = await completions(rollout, 1)
    assert c.token_ids.numel() == 3


async def test_weights_without_the_run_token_are_refused(rollout: RoleHarness, weights: RpcEndpoint) -> None:
    """Another process of the same user, without the token: an empty update to version
    10**9 would make the rollout refuse every real one after it."""
    for forged in ("", "0" * 64):
        bogus = wire.WeightBucket(version=10**9, index=0, last=True, tensors={}, token=forged)
        with pytest.raises(RemoteError, match="no valid run token") as info:
            await weights.request(bogus, timeout=10)
        assert info.value.code == wire.ErrorCode.REFUSED
    await rollout.send(generate("still", 1, 4))
    (c,) = await completions(rollout, 1)
    assert c.versions.tolist() == [1] * 4  # still at the version of the real update above


async def test_malformed_input_is_dropped_and_role_keeps_serving(rollout: RoleHarness) -> None:
    assert rollout.peer is not None
    raw = rollout.zmq.socket(zmq.DEALER)
    raw.plain_username, raw.plain_password = b"tandem", read_token(rollout.cfg.run_dir).encode()  # a run member
    raw.connect(rollout.peer.address)
    await raw.send_multipart([b"garbage"])
    await raw.send_multipart([b"bad", b"\x90"])
    await raw.send_multipart([wire.Header(99, 20, 0, 1).pack(), b"\x90"])
    raw.close(linger=500)
    await rollout.send(generate("still-alive", 1, 3))
    c = await rollout.next(wire.Completion)
    assert c.request_id == "still-alive" and c.token_ids.numel() == 3
    # The bad frames went to another socket (the weights server): their drops are logged
    # on their own schedule, so wait for them rather than assume an order across sockets.
    log = Path(rollout.cfg.run_dir) / "logs" / "rollout-0.jsonl"
    deadline = time.monotonic() + 30
    while True:
        lines = log.read_text().splitlines()
        reasons = {json.loads(line).get("reason") for line in lines if '"message_dropped"' in line}
        if {"truncated", "bad_header", "schema_version"} <= reasons or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert {"truncated", "bad_header", "schema_version"} <= reasons


async def test_pipelined_small_buckets_load_the_same_weights_as_one_message_each(rollout: RoleHarness) -> None:
    """The trainer's sender keeps two zmq buckets in flight (roles/weights/sender.py):
    the tiny model in 16 KiB buckets lands exactly as the same tensors sent plainly do."""
    from tests.helpers.weights import TrainerSide

    cfg = rollout.cfg
    side = TrainerSide(rollout, "zmq", torch.device("cpu"), timeout_s=30.0, bucket_mb=1, bucket_bytes=16 << 10)
    await side.connect()
    try:
        tensors = model_tensors(rollout, 0.75)
        result = await side.push(2, tensors)
    finally:
        await side.aclose()
    assert not result.failed and result.applied["rollout-0"].version == 2
    assert result.applied["rollout-0"].num_tensors == len(tensors)
    assert (await rollout.next(wire.WeightsApplied)).version == 2
    assert result.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert result.num_bytes > 8 * (16 << 10)  # many buckets, so two were in flight
    ep = rollout.connect(rollout.peer.address if rollout.peer else "", name="checker")
    try:
        pipelined = await ep.request(wire.WeightChecksums(token=read_token(cfg.run_dir)), timeout=60)
        await push(ep, 3, tensors, read_token(cfg.run_dir))  # the same tensors, 8 a message
        assert (await rollout.next(wire.WeightsApplied)).version == 3
        plain = await ep.request(wire.WeightChecksums(token=read_token(cfg.run_dir)), timeout=60)
    finally:
        await ep.aclose()
    assert isinstance(pipelined, wire.WeightChecksums) and isinstance(plain, wire.WeightChecksums)
    assert pipelined.version == 2 and plain.version == 3
    assert pipelined.sums == plain.sums and len(plain.sums) > 0


async def test_engine_death_ends_the_role_with_its_error(rollout: RoleHarness) -> None:
    """Runs last: kills the module's engine."""
    assert rollout.proc is not None
    engine_procs = [
        p
        for p in psutil.Process(rollout.proc.pid).children(recursive=True)
        if any(tag in " ".join(p.cmdline()) or tag in p.name() for tag in ("EngineCore", "VLLM::Worker"))
    ]
    assert engine_procs, [p.name() for p in psutil.Process(rollout.proc.pid).children(recursive=True)]
    engine_procs[0].kill()
    deadline = time.monotonic() + 30
    while rollout.proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert rollout.proc.returncode not in (None, 0)
    log = (Path(rollout.cfg.run_dir) / "logs" / "rollout-0.jsonl").read_text()
    fatal = [json.loads(line) for line in log.splitlines() if '"fatal"' in line]
    assert fatal and "engine" in fatal[-1]["cause"].lower()
