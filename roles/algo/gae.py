"""Token-level generalised advantage estimation (Schulman et al. 2016) and masked whitening.

Invariant: only positions where the mask is 1 carry advantages and returns; everything
outside the mask is exactly 0, and the state after the last masked token is terminal
(its value is 0), whatever the padding holds.

Gaps (multi-turn: environment tokens with mask 0 between assistant turns) are skipped,
as verl's `compute_gae_advantage_return` does: the recursion runs over the masked tokens
alone, so the last assistant token before a gap bootstraps from the value of the first
assistant token after it, and gamma / lambda are applied once per assistant token (an
observation costs no discount). Rewards and values at unmasked positions are ignored:
put a turn's reward on a masked token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from roles.algo.masked import masked_mean


def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """(advantages_BT, returns_BT) with returns = advantages + values on masked tokens.

    Each row is one trajectory; its mask may start after position 0, end before T and
    have gaps (see the module docs: the recursion carries across them). Without gaps
    this is textbook GAE over the masked span. Pass detached values: the result is meant
    as a training target.
    """
    valid_BT = mask_BT != 0
    zeros_B = values_BT.new_zeros(values_BT.shape[0])
    next_value_B, next_adv_B = zeros_B, zeros_B
    adv_columns: list[Tensor] = []
    for t in reversed(range(values_BT.shape[1])):
        valid_B = valid_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        # Outside the mask both carries pass through unchanged: trailing padding leaves them at
        # their start (0, a terminal state), a gap hands them to the token before it.
        next_adv_B = torch.where(valid_B, delta_B + gamma * lam * next_adv_B, next_adv_B)
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        adv_columns.append(torch.where(valid_B, next_adv_B, zeros_B))
    adv_BT = torch.stack(adv_columns[::-1], dim=1)
    returns_BT = torch.where(valid_BT, adv_BT + values_BT, torch.zeros_like(adv_BT))
    return adv_BT, returns_BT


def whiten(x_BT: Tensor, mask_BT: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean and population variance over masked entries.

    With `shift_mean=False` the mean is added back (scale only). Unmasked entries are 0;
    an all-zero mask returns all zeros.
    """
    mean = masked_mean(x_BT, mask_BT)
    var = masked_mean((x_BT - mean) ** 2, mask_BT)
    whitened_BT = (x_BT - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened_BT = whitened_BT + mean
    return torch.where(mask_BT != 0, whitened_BT, torch.zeros_like(whitened_BT))
