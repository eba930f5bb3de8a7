"""The environment API of multi-turn rollouts (`rollout.env: module:factory`).

A user module exposes a factory; the rollout role calls it once per sample and runs the
loop itself (roles/rollout/episode.py): generate a turn, hand it to `step`, append the
observation, generate again. An environment object is

    class MyEnv:
        async def reset(self, prompt: EnvPrompt) -> Observation: ...   # optional
        async def step(self, turn: Turn) -> Step: ...

What an environment may rely on:
* One object per sample; its methods are awaited one at a time, `reset` (if it has one)
  before the first turn, `step` after each assistant turn. An object with a `close`
  method (sync or async) has it called once the sample is finished, whatever happened.
* `Turn.token_ids` are the tokens exactly as sampled (never re-tokenised); `Turn.text`
  is their decoding. An observation is token ids (inserted as they are) or text
  (encoded with the model's tokenizer, no special tokens added); either way its tokens
  are appended after the turn with loss mask 0: they are context, never trained on.
  The environment supplies any chat framing (`<|im_end|>\\n<|im_start|>user\\n...`).
* The sample's reward from the environment is the sum of the `reward`s it returned
  (None when it returned none); the controller adds it to the reward functions' score.
The factory takes no argument, or one: an `EnvContext` (the tools, the tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Observation = Sequence[int] | str | None  # token ids, text to encode, or nothing


@dataclass(frozen=True)
class EnvPrompt:
    """What the sample starts from: the prompt's token ids and the dataset row's fields."""

    prompt_ids: list[int]
    text: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    sample_index: int = 0  # which of the group's n samples this is


@dataclass(frozen=True)
class Turn:
    """One assistant turn as sampled: its tokens, their text, and why it ended."""

    index: int  # 0 for the first turn
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class Step:
    """The environment's answer to a turn: what to append, a reward, whether it is over."""

    observation: Observation = None
    reward: float | None = None
    done: bool = False


class Environment(Protocol):
    async def step(self, turn: Turn) -> Step: ...


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class EnvContext:
    """Handed to a factory that takes one argument."""

    tools: Any  # roles.rollout.tools.ToolRegistry: `await tools.call(name, arguments)`
    tokenizer: Tokenizer | None
