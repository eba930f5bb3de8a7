"""Importance weights that correct for the behaviour policy (vLLM) against the proximal one.

Invariant: the weight of a token is a constant (no gradient), 0 outside the mask, and
depends only on log w = prox_logp - behav_logp: per token, or per sequence (the product of
its tokens' ratios, log clamped to [-20, 20]) broadcast to its tokens. "truncate" caps
the weight at `cap` (truncated IS, today's `importance_cap`); "mask" keeps a weight in
[low, high] as it is and sets every other to 0 (masked IS, as IcePop / verl's rejection
sampling), so those tokens (or whole sequences) leave the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from roles.algo.masked import masked_max, masked_mean, masked_sum

CORRECTION_MODES = ("truncate", "mask")
CORRECTION_LEVELS = ("token", "sequence")
_LOG_BOUND = 20.0


@dataclass(frozen=True)
class ISCorrection:
    mode: str = "truncate"
    level: str = "token"
    cap: float = 5.0  # truncate: the largest weight
    low: float = 0.0  # mask: weights below are masked
    high: float = float("inf")  # mask: weights above are masked


def importance_weights(
    prox_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor, c: ISCorrection
) -> tuple[Tensor, dict[str, float]]:
    """(weight_BT, metrics). Metrics over masked tokens: importance_weight_mean / _max (the
    raw weight), truncated_fraction, masked_fraction (the share of tokens, at sequence level
    the tokens of sequences, whose weight was truncated or masked), and
    behaviour_proximal_abs_diff, the mean |behav_logp - prox_logp|."""
    with torch.no_grad():
        log_w_BT = (prox_logp_BT - behav_logp_BT).float()
        if c.level == "sequence":
            log_w_B = masked_sum(log_w_BT, mask_BT, dim=-1)
            log_w_BT = log_w_B.unsqueeze(-1).expand_as(log_w_BT)
        elif c.level != "token":
            raise ValueError(f"unknown rollout correction level {c.level!r}; valid: {', '.join(CORRECTION_LEVELS)}")
        raw_BT = torch.exp(log_w_BT.clamp(-_LOG_BOUND, _LOG_BOUND))
        truncated_BT = torch.zeros_like(raw_BT, dtype=torch.bool)
        masked_BT = torch.zeros_like(truncated_BT)
        if c.mode == "truncate":
            truncated_BT = raw_BT > c.cap
            weight_BT = raw_BT.clamp(max=c.cap)
        elif c.mode == "mask":
            masked_BT = (raw_BT < c.low) | (raw_BT > c.high)
            weight_BT = torch.where(masked_BT, torch.zeros_like(raw_BT), raw_BT)
        else:
            raise ValueError(f"unknown rollout correction mode {c.mode!r}; valid: {', '.join(CORRECTION_MODES)}")
        metrics = {
            "importance_weight_mean": float(masked_mean(raw_BT, mask_BT)),
            "importance_weight_max": masked_max(raw_BT, mask_BT),
            "truncated_fraction": float(masked_mean(truncated_BT.float(), mask_BT)),
            "masked_fraction": float(masked_mean(masked_BT.float(), mask_BT)),
            "behaviour_proximal_abs_diff": float(masked_mean((behav_logp_BT - prox_logp_BT).abs(), mask_BT)),
        }
        return weight_BT * (mask_BT != 0), metrics
