"""Advantages from rewards, one entry point for every `algorithm.advantage` value:
`compute_advantages`. Per sample: GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline; per token:
REINFORCE++ and GAE (roles/algo/gae.py).

Invariant: every per-sample function maps rewards[S] to advantages[S] in the same order
and depends on group ids only through equality (ids need not be sorted or contiguous).
Singleton rule: a sample whose group has no other member has no baseline, so it gets
advantage 0 and takes no part in any batch statistics (verl instead gives it r / (1 + eps)
in GRPO). `reinforce_pp` and `gae` have no groups: they need none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from roles.algo.gae import gae_advantages, whiten

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # per sample
TOKEN_ESTIMATORS = ("reinforce_pp", "gae")  # per token: need mask_BT
ADVANTAGES = ADVANTAGE_ESTIMATORS + TOKEN_ESTIMATORS  # every `algorithm.advantage` value
GRPO_STDS = ("unbiased", "population")


def _as_float(rewards: Tensor) -> Tensor:
    return rewards if rewards.is_floating_point() else rewards.to(torch.float32)


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group size, group mean, group population variance)."""
    _, inverse_S = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse_S.max()) + 1 if inverse_S.numel() else 0
    zeros_G = rewards.new_zeros(num_groups)
    count_S = zeros_G.index_add(0, inverse_S, torch.ones_like(rewards))[inverse_S]
    mean_S = zeros_G.index_add(0, inverse_S, rewards)[inverse_S] / count_S
    var_S = zeros_G.index_add(0, inverse_S, (rewards - mean_S) ** 2)[inverse_S] / count_S
    return count_S, mean_S, var_S


def _whiten_batch(x: Tensor, eps: float) -> Tensor:
    """(x - mean) / (population std + eps) over the whole batch."""
    if x.numel() == 0:
        return x
    return (x - x.mean()) / (x.std(unbiased=False) + eps)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, std: str = "unbiased", eps: float = 1e-6
) -> Tensor:
    """(r - group mean) / (group std + eps), or r - group mean when not `norm_by_std`
    (Dr. GRPO). `std`: "unbiased" (Bessel-corrected, as verl and TRL) or "population".
    A group of identical rewards and a singleton get 0."""
    if std not in GRPO_STDS:
        raise ValueError(f"unknown GRPO std {std!r}; valid: {', '.join(GRPO_STDS)}")
    rewards = _as_float(rewards)
    count_S, mean_S, var_S = _group_stats(rewards, group_ids)
    adv_S = rewards - mean_S
    if norm_by_std:
        if std == "unbiased":
            var_S = var_S * count_S / (count_S - 1).clamp_min(1)
        # A constant group has a zero numerator; keep it 0 even when eps == 0.
        adv_S = adv_S / (var_S.sqrt() + eps).clamp_min(torch.finfo(adv_S.dtype).tiny)
    return torch.where(count_S > 1, adv_S, torch.zeros_like(adv_S))


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """r_i minus the mean of the other samples of its group (leave-one-out baseline)."""
    rewards = _as_float(rewards)
    count_S, mean_S, _ = _group_stats(rewards, group_ids)
    # r - (n*mean - r)/(n-1) == n/(n-1) * (r - mean); size-1 groups are zeroed below.
    adv_S = (rewards - mean_S) * count_S / (count_S - 1).clamp_min(1)
    return torch.where(count_S > 1, adv_S, torch.zeros_like(adv_S))


def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: r minus its group mean, then whitened over the batch's
    samples (population std, each sample once; singletons stay 0 and are left out)."""
    rewards = _as_float(rewards)
    count_S, _, _ = _group_stats(rewards, group_ids)
    centred_S = grpo_advantages(rewards, group_ids, norm_by_std=False)
    grouped = count_S > 1
    out_S = torch.zeros_like(centred_S)
    out_S[grouped] = _whiten_batch(centred_S[grouped], eps)
    return out_S


def reinforce_pp_advantages(
    rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025), per token: (advantages_BT, returns_BT).

    The return of a masked token is its reward plus gamma times the return of the next
    masked token of its row; after a row's last masked token the return is 0. Unmasked
    tokens (padding, and the observation tokens an environment inserts between assistant
    turns) add no reward and cost no discount: the return passes through them unchanged,
    so every turn gets the reward that comes after it. Advantages are the returns whitened
    over every masked token of the batch (mean and population variance over masked tokens
    only, eps inside the sqrt). Both outputs are exactly 0 outside the mask.

    Relation to verl: `compute_reinforce_plus_plus_outcome_advantage` in 0.9.1 carries the
    return through mask-0 tokens the same way (before that, e.g. 0.8.0.dev, it reset the
    return to 0 at every mask-0 token: `running_return * response_mask[:, t]`); its
    `masked_whiten` divides by the unbiased (Bessel-corrected) std, this by the population
    one. Without gaps (one contiguous masked span per row) the result is the same as
    resetting, so single-turn advantages are unchanged.
    """
    valid_BT = mask_BT != 0
    running_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    columns: list[Tensor] = []
    for t in reversed(range(rewards_BT.shape[1])):
        running_B = torch.where(valid_BT[:, t], rewards_BT[:, t] + gamma * running_B, running_B)
        columns.append(torch.where(valid_BT[:, t], running_B, torch.zeros_like(running_B)))
    returns_BT = torch.stack(columns[::-1], dim=1)
    return whiten(returns_BT, mask_BT, eps=eps), returns_BT


def _sample_advantages(name: str, rewards: Tensor, group_ids: Tensor, norm_by_std: bool, std: str) -> Tensor:
    if name == "grpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=norm_by_std, std=std)
    if name == "dr_grpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=False)
    if name == "rloo":
        return rloo_advantages(rewards, group_ids)
    return reinforce_pp_baseline_advantages(rewards, group_ids)


def outcome_token_rewards(rewards_S: Tensor, mask_BT: Tensor) -> Tensor:
    """[B, T] zeros with each row's reward on its last masked token (a row without one gets none)."""
    rewards_S = _as_float(rewards_S)
    rewards_BT = torch.zeros(mask_BT.shape, dtype=rewards_S.dtype, device=mask_BT.device)
    if mask_BT.shape[-1] == 0:
        return rewards_BT
    valid_BT = mask_BT != 0
    positions_T = torch.arange(mask_BT.shape[-1], device=mask_BT.device)
    positions_BT = positions_T.expand(mask_BT.shape).masked_fill(~valid_BT, -1)
    last_B = positions_BT.amax(dim=-1)
    rows_B = (last_B >= 0).nonzero().squeeze(-1)
    rewards_BT[rows_B, last_B[rows_B]] = rewards_S[rows_B]
    return rewards_BT


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    mask_BT: Tensor | None = None,
    span_BT: Tensor | None = None,
    token_rewards_BT: Tensor | None = None,
    values_BT: Tensor | None = None,
    norm_by_std: bool = True,
    std: str = "unbiased",
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Tensor:
    """The advantages of estimator `name`, any `algorithm.advantage` value (ADVANTAGES).

    `rewards[S]` are the samples' scalar rewards and `group_ids[S]` their groups (used by
    the per-sample estimators only). Without `mask_BT` the result is advantages[S] and
    `name` must be a per-sample estimator (ADVANTAGE_ESTIMATORS). With `mask_BT[S, T]` (1 on
    the tokens the policy sampled) the result is advantages[S, T]:
    - per-sample estimators write each sample's advantage on every position of `span_BT`
      (default `mask_BT`) and 0 elsewhere;
    - "reinforce_pp": `reinforce_pp_advantages(token_rewards_BT, mask_BT, gamma=gamma)`;
    - "gae": `gae_advantages(token_rewards_BT, values_BT, mask_BT, gamma=gamma, lam=lam)`,
      not whitened (whiten a batch with `whiten`); its returns are advantages + values on
      masked tokens. `values_BT` is required.
    `token_rewards_BT` defaults to each row's reward on its last masked token.
    `norm_by_std` and `std` apply to "grpo" only. An unknown `name` raises ValueError
    listing every valid one.
    """
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGES)}")
    if mask_BT is None:
        if name in TOKEN_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is per token: pass mask_BT")
        return _sample_advantages(name, rewards, group_ids, norm_by_std, std)
    if name in ADVANTAGE_ESTIMATORS:
        adv_S = _sample_advantages(name, rewards, group_ids, norm_by_std, std)
        return broadcast_to_tokens(adv_S, mask_BT if span_BT is None else span_BT)
    if token_rewards_BT is None:
        token_rewards_BT = outcome_token_rewards(rewards, mask_BT)
    if name == "reinforce_pp":
        return reinforce_pp_advantages(token_rewards_BT, mask_BT, gamma=gamma)[0]
    if values_BT is None:
        raise ValueError("advantage estimator 'gae' needs values_BT (the critic's values)")
    return gae_advantages(token_rewards_BT, values_BT, mask_BT, gamma=gamma, lam=lam)[0]


def broadcast_to_tokens(adv_S: Tensor, mask_BT: Tensor) -> Tensor:
    """[B, T] tensor holding each row's advantage on its masked tokens and 0 elsewhere."""
    return adv_S.unsqueeze(-1) * mask_BT.to(adv_S.dtype)
