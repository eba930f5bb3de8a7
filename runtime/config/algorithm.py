"""Advantages and KL: `algorithm.*`, with the overlong-response penalty."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.base import STRUCT, Doc
from runtime.config.distill import DistillConfig
from runtime.config.trainer import KLConfig


class AlgorithmConfig(msgspec.Struct, **STRUCT):
    advantage: Annotated[
        Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp", "gae"],
        Doc(
            description="Advantage estimator: grpo (group mean and std), dr_grpo (group mean only), rloo "
            "(leave-one-out mean), reinforce_pp_baseline (group mean, then whitened over the batch), reinforce_pp "
            "(token-level discounted returns with `gamma`, whitened over the batch's tokens), gae (critic)."
        ),
    ] = "grpo"
    norm_by_std: Annotated[bool, Doc(description="GRPO: divide by the group's reward std (false = dr_grpo).")] = True
    std: Annotated[
        Literal["unbiased", "population"],
        Doc(description="GRPO's group std: unbiased (Bessel-corrected, as verl and TRL) or population."),
    ] = "unbiased"
    gamma: Annotated[float, Doc(description="Discount of GAE and reinforce_pp.", ge=0, le=1)] = 1.0
    lam: Annotated[float, Doc(description="GAE lambda.", ge=0, le=1)] = 0.95
    whiten_advantages: Annotated[bool, Doc(description="GAE: whiten advantages over the batch.")] = True
    mismatch_warn: Annotated[
        float,
        Doc(description="Warn once when a staleness-0 step's kl_behaviour_proximal exceeds this (0: never).", ge=0),
    ] = 0.02
    mismatch_stop: Annotated[
        float,
        Doc(description="End the run when a staleness-0 step's kl_behaviour_proximal exceeds this (0: never).", ge=0),
    ] = 0.0
    kl: Annotated[KLConfig, Doc(description="Reference-policy KL.")] = msgspec.field(default_factory=KLConfig)
    distill: Annotated[
        DistillConfig, Doc(description="On-policy distillation from a teacher role (docs/distillation.md).")
    ] = msgspec.field(default_factory=DistillConfig)
    filter_groups: Annotated[
        bool,
        Doc(
            description="DAPO dynamic sampling: drop groups whose rewards are all equal (counted as dropped_filtered) "
            "and keep admitting until the batch is full."
        ),
    ] = False
    max_filter_rounds: Annotated[
        int,
        Doc(
            description="filter_groups: at most this many batches' worth of groups (x prompts_per_step) are filtered "
            "per step; past that, equal-reward groups are trained, so the run never stalls.",
            ge=1,
        ),
    ] = 4
    routing_replay: Annotated[
        Literal["disabled", "measure", "rollout"],
        Doc(
            description="Mixture-of-experts policies: `rollout` (R3) trains every token on the experts vLLM routed "
            "it to (the trainer's router still weighs them); `measure` only asks vLLM for its routing and reports how "
            "often the trainer's own routing differs (router_disagree); `disabled`: the trainer routes every token "
            "itself. Needs a GPU (vLLM-CPU cannot report routing)."
        ),
    ] = "disabled"


class OverlongConfig(msgspec.Struct, **STRUCT):
    """DAPO's soft overlong punishment, added to each sample's reward."""

    enabled: Annotated[bool, Doc(description="Penalise responses that end in the last `buffer` tokens.")] = False
    buffer: Annotated[
        int, Doc(description="Tokens before rollout.max_tokens where the penalty grows linearly.", ge=1)
    ] = 4
    penalty: Annotated[float, Doc(description="The penalty at rollout.max_tokens.", ge=0)] = 1.0
