"""The environment of configs/multiturn_tool_sleep_cpu.yaml: a multi-turn task whose every
observation comes from a slow tool, for the async-vs-sync benchmark (BENCHMARKS.md).

The task is roles/rollout/synthetic_env.py's copy-with-feedback over `TURNS` turns; the
feedback after each turn but the last goes through the registered tool `slow_feedback`,
which sleeps `sleep_s(seed)` seconds — uniform in [0, MAX_SLEEP_S), drawn from a seed made
of the prompt, the sample and the turn, so a sync and an async run of the same config
sleep the same amounts — and then returns the feedback text. The call goes through the
tool registry like any tool call (bounded by `rollout.tool_timeout_s`; a failure becomes
the observation).
"""

from __future__ import annotations

import asyncio
import random

from roles.rollout.environment import EnvContext, EnvPrompt, Step, Turn
from roles.rollout.synthetic_env import CopyWithFeedback

MAX_SLEEP_S = 2.0
TURNS = 3


def sleep_s(seed: str) -> float:
    """The tool's delay for `seed`: deterministic, uniform in [0, MAX_SLEEP_S)."""
    return random.Random(seed).uniform(0.0, MAX_SLEEP_S)


async def slow_feedback(text: str, seed: str) -> str:
    """The tool: `text`, after sleeping `sleep_s(seed)` seconds."""
    await asyncio.sleep(sleep_s(seed))
    return text


class SleepyFeedback(CopyWithFeedback):
    def __init__(self, context: EnvContext) -> None:
        super().__init__(turns=TURNS)
        self.tools = context.tools
        self.seed = ""

    async def reset(self, prompt: EnvPrompt) -> None:
        await super().reset(prompt)
        self.seed = f"{prompt.text}/{prompt.sample_index}"

    async def step(self, turn: Turn) -> Step:
        step = await super().step(turn)
        if step.done:
            return step
        result = await self.tools.call("slow_feedback", {"text": step.observation, "seed": f"{self.seed}/{turn.index}"})
        return Step(observation=result.text)


def factory(context: EnvContext) -> SleepyFeedback:
    return SleepyFeedback(context)
