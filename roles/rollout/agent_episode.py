"""One agent episode's record: every model call the agent made, token in, token out.

An agent that owns its loop (docs/ecosystem.md) sends whole conversations; the episode
turns them into one trajectory the trainer can use. What a caller may rely on:
* The context of every call is `request prompt + trajectory so far`, and the trajectory
  holds exactly the tokens the model was given and sampled: sampled tokens with their
  behaviour logprobs and policy versions (loss mask 1), everything else (the agent's
  prompt, tool results, its next messages, the chat template's framing) with loss mask 0,
  as roles/rollout/episode.py keeps a multi-turn sample.
* A call whose prompt continues the episode (`extend`: its ids begin with the context)
  appends only what is new. A call that does not (the agent rewrote its history) starts a
  new segment: the trajectory restarts from that prompt and the sample is the last segment
  (`segments` counts them). Its prompt must still begin with the request's prompt ids, or
  the call is refused.
* The trajectory's length is bounded by `budget` (a call that would pass it is refused
  and the sample ends with finish LENGTH) and its calls by `max_calls`.
* A call vLLM refuses (a grammar it cannot build, a prompt too long: what `vllm serve`
  answers with a 400) is refused with vLLM's error and leaves the episode as it was.
* `reward` is the last value the agent reported (None: it reported none).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from roles.generation.engine import Sample
from roles.rollout.episode import Trajectory
from runtime.errors import TandemError
from transport.wire import FinishReason

# (context ids, max_tokens, call index, grammar: vLLM's StructuredOutputsParams or None) -> Sample
Sampler = Callable[[list[int], int, int, Any], Awaitable[Sample]]


class CallRefused(TandemError, ValueError):
    """A model call the episode cannot serve; its one-line message goes back to the agent."""


@dataclass
class ChatTurn:
    """The last chat call: its messages plus the reply as returned, for the next call's bridge."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    completion_text: str  # the sampled tokens decoded, special tokens kept


@dataclass
class AgentEpisode:
    episode_id: str
    prompt_ids: list[int]  # the request's prompt: every segment starts with it
    sample: Sampler
    budget: int
    max_calls: int
    max_tokens: int  # the run's rollout.max_tokens: a call may ask for fewer
    traj: Trajectory = field(default_factory=Trajectory)
    calls: int = 0
    segments: int = 0
    reward: float | None = None
    finished: bool = False
    last_chat: ChatTurn | None = None
    last_text: str | None = None  # /v1/completions: the last prompt text plus its completion
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def context(self) -> list[int]:
        return self.prompt_ids + self.traj.token_ids

    async def generate(self, ids: list[int], max_tokens: int, structured: Any = None) -> Sample:
        """Sample the next reply from `ids` (see the module docs), under grammar `structured`
        if given; raises CallRefused."""
        if self.finished:
            raise CallRefused(f"episode {self.episode_id} has ended")
        if self.calls >= self.max_calls:
            raise CallRefused(f"episode {self.episode_id} made its {self.max_calls} calls (rollout.max_turns)")
        continues = self._continues(ids)
        room = self.budget - (len(ids) - len(self.prompt_ids))  # what the trajectory leaves after the prompt
        if room <= 0:
            self._extend(ids, continues)
            self.traj.finish_reason = FinishReason.LENGTH
            self.finished = True
            raise CallRefused(f"episode {self.episode_id} spent its {self.budget} tokens (rollout.max_total_tokens)")
        s = await self.sample(ids, max(1, min(max_tokens, room)), self.calls, structured)
        if s.refused:  # vLLM refused the request (as `vllm serve` would, with a 400): the episode is as it was
            raise CallRefused(f"invalid request: vLLM refused it: {s.error}")
        self._extend(ids, continues)
        self.calls += 1
        self.traj.sampled(s)
        self.traj.num_turns += 1
        self.traj.finish_reason = s.finish_reason
        if s.error:
            self.traj.error = s.error
            self.finished = True
        return s

    def _continues(self, ids: list[int]) -> bool:
        """Whether the call's `ids` continue the segment (they begin with the context); a
        call that starts a new one must begin with the request's prompt, or it is refused."""
        context = self.context()
        if self.segments and ids[: len(context)] == context:
            return True
        if ids[: len(self.prompt_ids)] != self.prompt_ids:
            raise CallRefused(
                "the agent's prompt does not begin with the run's prompt tokens; let the agent render its own "
                "(data.render_prompt=false)"
            )
        return False

    def _extend(self, ids: list[int], continues: bool) -> None:
        """Record the call's prompt: what is new after the context, or a new segment."""
        if continues:
            self.traj.observed(ids[len(self.context()) :])
            return
        self.segments += 1
        self.traj = Trajectory()
        self.last_chat, self.last_text = None, None
        self.traj.observed(ids[len(self.prompt_ids) :])

    def report(self, reward: float) -> None:
        self.reward = float(reward)

    def result(self, fallback_version: int) -> Trajectory:
        """The trajectory to train: the last segment, trailing inserted tokens dropped (no
        sampled token follows them), the agent's reward as the environment's."""
        t = self.traj
        end = len(t.loss_mask)
        while end and not t.loss_mask[end - 1]:
            end -= 1
        if end < len(t.loss_mask):
            t.token_ids, t.logprobs = t.token_ids[:end], t.logprobs[:end]
            t.versions, t.loss_mask = t.versions[:end], t.loss_mask[:end]
            t._pending = [i for i in t._pending if i < end]
        t.reward = self.reward
        return t.settle(fallback_version)
