"""The benchmark's slow-tool environment (roles/rollout/sleepy_tool_env.py): its sleeps are
uniform in [0, 2) s and the same for the same seed; its feedback goes through the real
tool registry and takes that long; the last turn is rewarded and ends the sample."""

from __future__ import annotations

import asyncio
import statistics
import time

from roles.rollout.environment import EnvContext, EnvPrompt, Step, Turn
from roles.rollout.sleepy_tool_env import MAX_SLEEP_S, TURNS, factory, sleep_s
from roles.rollout.tools import ToolRegistry


def test_sleeps_are_seeded_and_spread_over_zero_to_two_seconds() -> None:
    delays = [sleep_s(f"prompt/{i}/0") for i in range(2000)]
    assert delays == [sleep_s(f"prompt/{i}/0") for i in range(2000)]
    assert 0.0 <= min(delays) < 0.05 and MAX_SLEEP_S - 0.05 < max(delays) < MAX_SLEEP_S
    assert abs(statistics.fmean(delays) - MAX_SLEEP_S / 2) < 0.05


def test_feedback_comes_from_the_slow_tool_and_the_last_turn_is_rewarded() -> None:
    tools = ToolRegistry(["roles.rollout.sleepy_tool_env:slow_feedback"], timeout_s=5.0)
    env = factory(EnvContext(tools=tools, tokenizer=None))

    async def episode() -> list[tuple[Step, float]]:
        await env.reset(EnvPrompt(prompt_ids=[97, 98], text="ab", answer="ab", sample_index=3))
        out = []
        for index in range(TURNS):
            start = time.monotonic()
            step = await env.step(Turn(index=index, token_ids=[97, 120], text="ax", finish_reason="stop"))
            out.append((step, time.monotonic() - start))
        return out

    steps = asyncio.run(episode())
    for index, (step, elapsed) in enumerate(steps[:-1]):
        assert step.observation == "\nscore 1/2, copy: ab\n" and not step.done
        assert abs(elapsed - sleep_s(f"ab/3/{index}")) < 0.5
    last, _ = steps[-1]
    assert last.done and last.reward == 0.5
