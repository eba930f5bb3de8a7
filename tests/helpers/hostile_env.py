"""A hostile multi-turn environment for tests/integration/test_hostile_run.py: the synthetic copy task
(roles/rollout/synthetic_env.py), but the first sample of each of the first prompts the
rollout sees misbehaves, each in another of the ways that used to end the run (so every
fault comes up exactly once, in the first step); every other sample behaves."""

from __future__ import annotations

import threading
import time
from typing import Any

from roles.rollout.environment import EnvPrompt, Step, Turn
from roles.rollout.synthetic_env import CopyWithFeedback

FAULTS = ("out_of_vocab", "blocks", "huge_text", "millions_of_ids", "string_reward", "huge_reward")
ERRORS = ("out_of_vocab", "blocks", "huge_text", "string_reward")  # the faults that fail their sample
_seen: dict[str, str] = {}
_lock = threading.Lock()


def fault_of(letters: str) -> str:
    """The fault of the prompt with these letters: the k-th distinct prompt seen gets FAULTS[k]."""
    with _lock:
        if letters not in _seen:
            _seen[letters] = FAULTS[len(_seen)] if len(_seen) < len(FAULTS) else ""
        return _seen[letters]


class Hostile(CopyWithFeedback):
    def __init__(self) -> None:
        super().__init__()
        self.fault = ""

    async def reset(self, prompt: EnvPrompt) -> None:
        await super().reset(prompt)
        fault = fault_of(self.letters)
        self.fault = fault if prompt.sample_index == 0 else ""

    def step(self, turn: Turn) -> Any:  # sync on purpose: a blocking step must not block the rollout
        if self.fault == "blocks":
            time.sleep(60)
        if turn.index == 0 and self.fault == "out_of_vocab":
            return Step(observation=[10, 1_000_000])
        if turn.index == 0 and self.fault == "huge_text":
            return Step(observation="x" * (50 * 2**20))
        if turn.index == 0 and self.fault == "millions_of_ids":
            return Step(observation=[10] * 5_000_000)
        if turn.index == 1 and self.fault == "string_reward":
            return Step(reward="high", done=True)  # type: ignore[arg-type]
        if turn.index == 1 and self.fault == "huge_reward":
            return Step(reward=1e308, done=True)
        return super().step(turn)  # a coroutine: the rollout awaits it on the environment's thread


def factory() -> Hostile:
    return Hostile()
