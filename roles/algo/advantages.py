"""Advantages from scalar rewards: per sample (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline)
and per token (REINFORCE++).

Invariant: every per-sample function maps rewards[S] to advantages[S] in the same order
and depends on group ids only through equality (ids need not be sorted or contiguous).
Singleton rule: a sample whose group has no other member has no baseline, so it gets
advantage 0 and takes no part in any batch statistics (verl instead gives it r / (1 + eps)
in GRPO). `reinforce_pp` has no groups: it needs none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from roles.algo.gae import whiten

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # per sample
TOKEN_ESTIMATORS = ("reinforce_pp",)  # per token: reinforce_pp_advantages
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
    """REINFORCE++ (Hu 2025), per token: (advantages_BT, returns_BT). The return of a token
    is the discounted sum of the token rewards after it within its row's mask (the scalar
    reward sits on the last response token), and the advantages are those returns whitened
    over every masked token of the batch (population variance, eps inside the sqrt)."""
    valid_BT = mask_BT != 0
    running_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    columns: list[Tensor] = []
    for t in reversed(range(rewards_BT.shape[1])):
        running_B = torch.where(valid_BT[:, t], rewards_BT[:, t] + gamma * running_B, torch.zeros_like(running_B))
        columns.append(running_B)
    returns_BT = torch.stack(columns[::-1], dim=1)
    return whiten(returns_BT, mask_BT, eps=eps), returns_BT


def compute_advantages(
    name: str, rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, std: str = "unbiased"
) -> Tensor:
    """Dispatch to the per-sample estimator `name` (one of ADVANTAGE_ESTIMATORS).
    `norm_by_std` and `std` apply to "grpo" only."""
    if name == "grpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=norm_by_std, std=std)
    if name == "dr_grpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=False)
    if name == "rloo":
        return rloo_advantages(rewards, group_ids)
    if name == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, group_ids)
    raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")


def broadcast_to_tokens(adv_S: Tensor, mask_BT: Tensor) -> Tensor:
    """[B, T] tensor holding each row's advantage on its masked tokens and 0 elsewhere."""
    return adv_S.unsqueeze(-1) * mask_BT.to(adv_S.dtype)
