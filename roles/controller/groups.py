"""Prompt groups (n completions of one prompt) from dispatch to training.

A group is admitted once, then moves through: dispatched → complete (all n samples
back) → rewarded → ready (queued for training) → trained or dropped. The controller
keeps every group in exactly one of its containers, which is what makes the
"trained or dropped exactly once" accounting checkable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roles.controller.dataset import Prompt
from transport.wire import FinishReason, SamplingSpec


@dataclass
class SampleRec:
    index: int
    token_ids: torch.Tensor  # int64 [R]
    logprobs: torch.Tensor  # float32 [R]
    versions: torch.Tensor  # int32 [R]
    finish_reason: FinishReason
    error: str = ""
    reward: float | None = None
    reward_error: str = ""  # why the reward role gave this sample no reward ("" when it did)
    reward_reason: str = ""  # that failure in a word (timeout, nonfinite, raised, ...: RewardScore.reason)
    token_rewards: torch.Tensor | None = None  # float32 [R] (GAE: reward + KL penalty per token)
    values: torch.Tensor | None = None  # float32 [R] critic values of response tokens
    advantages: torch.Tensor | None = None  # float32 [R] token advantages (GAE)
    returns: torch.Tensor | None = None  # float32 [R]
    ref_logprobs: torch.Tensor | None = None  # float32 [R] reference policy (KL in reward)
    loss_mask: torch.Tensor | None = None  # uint8 [R]: 0 on environment tokens (multi-turn); None: all 1
    env_reward: float | None = None  # the environment's reward (multi-turn), added to the functions'
    model_reward: float | None = None  # the reward_model role's score (before reward.model_weight), if it gave one
    num_turns: int = 0  # assistant turns (multi-turn); 0 for a single-turn sample
    routed_experts: torch.Tensor | None = None  # uint8|int16 [N, layers, top_k]: vLLM's routing, prompt first
    teacher_logprobs: torch.Tensor | None = None  # float32 [R] the distillation teacher's, if it gave them
    teacher_error: str = ""  # why the teacher gave this sample none ("" when it did, or there is no teacher)

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def num_sampled(self) -> int:
        """Tokens the policy sampled (the ones trained on); `length` for a single-turn sample."""
        return self.length if self.loss_mask is None else int(self.loss_mask.sum())

    def mask(self) -> torch.Tensor:
        """float32 [R]: 1 on sampled tokens, 0 on environment tokens."""
        return torch.ones(self.length) if self.loss_mask is None else self.loss_mask.float()


@dataclass
class Group:
    gid: int
    prompt: Prompt
    n: int
    request_id: str
    admitted_version: int
    rollout: bytes = b""
    dispatched_at: float = 0.0  # Unix time of its latest send to a rollout (0: not sent)
    gen_started: float = 0.0  # Unix time its earliest sample began generating (0: none back yet)
    first_arrival: float = 0.0  # Unix time its first sample came back (0: none back yet)
    last_arrival: float = 0.0  # Unix time its latest sample came back
    ready_at: float = 0.0  # Unix time it was scored and queued for training (0: not yet)
    samples: dict[int, SampleRec] = field(default_factory=dict)
    attempts: int = 1
    value_version: int | None = None  # critic version that computed the values (GAE)
    sampling: SamplingSpec | None = None  # a side group's own sampling (validation); None: the run's

    @property
    def complete(self) -> bool:
        return len(self.samples) == self.n

    @property
    def rewarded(self) -> bool:
        return self.complete and all(s.reward is not None for s in self.samples.values())

    @property
    def rewards_equal(self) -> bool:
        """Every sample has the same reward (GRPO's advantages are then all 0)."""
        return len({s.reward for s in self.samples.values()}) <= 1

    @property
    def error(self) -> str:
        return next((s.error for s in self.samples.values() if s.error), "")

    def forget_generation(self) -> None:
        """Drop what a lost rollout generated for this group, so it can be sent again."""
        self.samples.clear()
        self.rollout = b""
        self.gen_started = self.first_arrival = self.last_arrival = 0.0

    @property
    def token_versions(self) -> tuple[int, int] | None:
        """The oldest and newest policy version of any of its tokens; None without tokens."""
        spans = [(int(s.versions.min()), int(s.versions.max())) for s in self.samples.values() if s.versions.numel()]
        return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None

    @property
    def version(self) -> int:
        """The group's staleness anchor: the oldest policy version of any of its tokens,
        or of the critic that valued them (GAE), whichever is older."""
        span = self.token_versions
        mins = [span[0]] if span is not None else []
        if self.value_version is not None:
            mins.append(self.value_version)
        return min(mins) if mins else self.admitted_version

    def ordered(self) -> list[SampleRec]:
        return [self.samples[i] for i in sorted(self.samples)]
