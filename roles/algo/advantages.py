"""Per-sample (sequence-level) advantages from scalar rewards.

Invariant: every function maps rewards[S] to advantages[S] in the same order, depends on
group ids only through equality (ids need not be sorted or contiguous), and gives 0 to
a sample whose group has no other member.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")


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


def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps), or r - group mean when not `norm_by_std`.

    The std is the population std (unbiased=False), so a group of identical rewards
    gets 0 and a group of size 1 gets 0.
    """
    rewards = _as_float(rewards)
    count_S, mean_S, var_S = _group_stats(rewards, group_ids)
    adv_S = rewards - mean_S
    if norm_by_std:
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


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: rewards whitened over the whole batch (population std).

    With `group_ids` (REINFORCE++-baseline) each reward first has its group mean
    subtracted, then the result is whitened over the batch.
    """
    rewards = _as_float(rewards)
    if group_ids is not None:
        rewards = grpo_advantages(rewards, group_ids, norm_by_std=False)
    return _whiten_batch(rewards, eps)


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor | None, *, norm_by_std: bool = True) -> Tensor:
    """Dispatch to the estimator `name` ("grpo" | "rloo" | "reinforce_pp").

    `norm_by_std` applies to "grpo" only; `group_ids` may be None only for "reinforce_pp".
    """
    if name in ("grpo", "rloo") and group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group ids")
    if name == "grpo":
        assert group_ids is not None
        return grpo_advantages(rewards, group_ids, norm_by_std=norm_by_std)
    if name == "rloo":
        assert group_ids is not None
        return rloo_advantages(rewards, group_ids)
    if name == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_ids)
    raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")


def broadcast_to_tokens(adv_S: Tensor, mask_BT: Tensor) -> Tensor:
    """[B, T] tensor holding each row's advantage on its masked tokens and 0 elsewhere."""
    return adv_S.unsqueeze(-1) * mask_BT.to(adv_S.dtype)
