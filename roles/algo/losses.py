"""Token-level losses for the trainer: decoupled PPO policy loss, clipped value loss.

Invariant: every loss is a differentiable scalar reduced by `aggregate`, inputs are
never modified, an all-zero mask gives loss 0 with the graph still attached, and every
metric is a python float computed without grad over masked tokens only (0.0 if none).
"""

from __future__ import annotations

import torch
from torch import Tensor

from roles.algo.kl import kl_penalty
from roles.algo.masked import aggregate, masked_max, masked_mean, masked_sum

__all__ = [
    "aggregate",
    "entropy_from_logits",
    "explained_variance",
    "masked_mean",
    "masked_sum",
    "ppo_policy_loss",
    "token_logprobs",
    "value_loss",
]

# exp() of a float32 log-ratio overflows near 88; tokens beyond the bound get no gradient.
_LOG_RATIO_BOUND = 20.0


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position, in float32: logsumexp(l) - sum(softmax(l) * l).

    Logits must be finite. They are shifted by their row max first (entropy is shift
    invariant), so large logits lose no precision.
    """
    logits_BTV = logits_BTV.float()
    logits_BTV = logits_BTV - logits_BTV.max(dim=-1, keepdim=True).values.detach()
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs_BTV * logits_BTV).sum(-1)


def token_logprobs(logits_BTV: Tensor, targets_BT: Tensor) -> Tensor:
    """log_softmax(logits)[targets] per position, in float32; targets must be valid ids everywhere."""
    logits_BTV = logits_BTV.float()
    target_logits_BT = logits_BTV.gather(-1, targets_BT.long().unsqueeze(-1)).squeeze(-1)
    return target_logits_BT - torch.logsumexp(logits_BTV, dim=-1)


def _policy_metrics(
    ratio_BT: Tensor, unclipped_BT: Tensor, clipped_BT: Tensor, weight_BT: Tensor, mask_BT: Tensor, cap: float
) -> dict[str, float]:
    return {
        "clip_fraction": float(masked_mean((clipped_BT < unclipped_BT).float(), mask_BT)),
        "importance_weight_max": masked_max(weight_BT, mask_BT),
        "importance_weight_mean": float(masked_mean(weight_BT, mask_BT)),
        "ratio_max": masked_max(ratio_BT, mask_BT),
        "truncated_fraction": float(masked_mean((weight_BT > cap).float(), mask_BT)),
    }


def ppo_policy_loss(
    logp_BT: Tensor,
    prox_logp_BT: Tensor,
    behav_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    importance_cap: float,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO loss (Hilton et al. 2022, AReaL): -w * min(r * A, clip(r, 1-lo, 1+hi) * A).

    r = exp(logp - prox_logp) is the trust-region ratio against the proximal policy;
    w = min(exp(prox_logp - behav_logp), importance_cap) corrects for the behaviour
    policy that sampled the tokens. Only `logp_BT` receives gradient: prox, behaviour
    and advantages are treated as constants. The log-ratio is clamped to [-20, 20].
    Metrics: clip_fraction, importance_weight_max / _mean (untruncated w),
    kl_behaviour_proximal (k3 of KL(prox || behav)), ratio_max, truncated_fraction.
    """
    prox_logp_BT, behav_logp_BT, adv_BT = prox_logp_BT.detach(), behav_logp_BT.detach(), adv_BT.detach()
    ratio_BT = torch.exp((logp_BT - prox_logp_BT).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_BT
    weight_BT = torch.exp(prox_logp_BT - behav_logp_BT)
    per_token_BT = -weight_BT.clamp(max=importance_cap) * torch.minimum(unclipped_BT, clipped_BT)
    loss = aggregate(per_token_BT, mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics = _policy_metrics(ratio_BT, unclipped_BT, clipped_BT, weight_BT, mask_BT, importance_cap)
        kl_BT = kl_penalty(prox_logp_BT, behav_logp_BT, "k3")
        metrics["kl_behaviour_proximal"] = float(masked_mean(kl_BT, mask_BT))
    return loss, metrics


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip: float,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped value loss 0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2).

    `clip == 0` disables clipping (plain 0.5 * (v - R)^2). Only `values_BT` receives
    gradient. Metrics: value_clip_fraction (clipped term strictly larger), value_mean.
    """
    old_values_BT, returns_BT = old_values_BT.detach(), returns_BT.detach()
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip > 0:
        clipped_values_BT = torch.clamp(values_BT, old_values_BT - clip, old_values_BT + clip)
        clipped_BT = (clipped_values_BT - returns_BT) ** 2
    else:
        clipped_BT = unclipped_BT
    per_token_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT)
    loss = aggregate(per_token_BT, mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics = {
            "value_clip_fraction": float(masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)),
            "value_mean": float(masked_mean(values_BT, mask_BT)),
        }
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var[R - V] / Var[R] over masked entries (population variances).

    Returns 0.0 when Var[R] is 0 (including an empty mask), where the ratio is undefined.
    """
    with torch.no_grad():
        values, returns = values.float(), returns.float()
        var_returns = _masked_var(returns, mask)
        if var_returns <= 0:
            return 0.0
        return float(1.0 - _masked_var(returns - values, mask) / var_returns)


def _masked_var(x: Tensor, mask: Tensor) -> Tensor:
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)
