"""Token-level losses for the trainer: decoupled PPO policy losses (vanilla, dual-clip,
GSPO, CISPO), clipped value loss.

Invariant: every loss is a differentiable scalar reduced by `aggregate`, inputs are
never modified, an all-zero mask gives loss 0 with the graph still attached, and every
metric is a python float computed without grad over masked tokens only (0.0 if none).
"""

from __future__ import annotations

import torch
from torch import Tensor

from roles.algo.masked import aggregate, masked_max, masked_mean, masked_sum
from roles.algo.rollout_correction import ISCorrection, importance_weights

__all__ = [
    "aggregate",
    "behaviour_proximal_kl",
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
_GSPO_LOG_RATIO_MAX = 10.0
POLICY_LOSS_MODES = ("vanilla", "dual-clip", "gspo", "cispo")


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


def _ratio(logp_BT: Tensor, prox_logp_BT: Tensor) -> Tensor:
    return torch.exp((logp_BT - prox_logp_BT).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))


def _gspo_ratio(logp_BT: Tensor, prox_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """GSPO's token ratio sg[s_i] * p / sg[p], s_i = exp(mean log-ratio of row i): its value
    is the sequence's geometric-mean ratio, its gradient each token's own (log clamped at 10, as verl)."""
    log_s_B = masked_mean(logp_BT - prox_logp_BT, mask_BT, dim=-1)
    log_ratio_BT = logp_BT - logp_BT.detach() + log_s_B.detach().unsqueeze(-1)
    return torch.exp(log_ratio_BT.clamp(max=_GSPO_LOG_RATIO_MAX))


def _surrogate(
    mode: str, logp_BT: Tensor, prox_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip: tuple[float, float, float]
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(per-token loss before the importance weight, ratio, mode metrics)."""
    low, high, ratio_c = clip
    ratio_BT = _gspo_ratio(logp_BT, prox_logp_BT, mask_BT) if mode == "gspo" else _ratio(logp_BT, prox_logp_BT)
    clipped_ratio_BT = ratio_BT.clamp(1.0 - low, 1.0 + high)
    if mode == "cispo":
        loss_BT = -clipped_ratio_BT.detach() * adv_BT * logp_BT
        clip_fraction = masked_mean((clipped_ratio_BT != ratio_BT).float(), mask_BT)
        return loss_BT, ratio_BT, {"clip_fraction": float(clip_fraction)}
    unclipped_BT, clipped_BT = -ratio_BT * adv_BT, -clipped_ratio_BT * adv_BT
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    metrics = {"clip_fraction": float(masked_mean((clipped_BT > unclipped_BT).float(), mask_BT))}
    if mode == "dual-clip":
        # Dual-clip PPO (Ye et al. 2020): for A < 0 the loss is bounded by -c * A.
        lower_BT = -ratio_c * adv_BT
        dual_BT = (adv_BT < 0) & (loss_BT > lower_BT)
        loss_BT = torch.where(adv_BT < 0, torch.minimum(loss_BT, lower_BT), loss_BT)
        metrics["dual_clip_fraction"] = float(masked_mean(dual_BT.float(), mask_BT))
    return loss_BT, ratio_BT, metrics


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
    mode: str = "vanilla",
    clip_ratio_c: float = 3.0,
    correction: ISCorrection | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO loss (Hilton et al. 2022, AReaL) w * L(r, A), aggregated by `agg`.

    r = exp(logp - prox_logp) is the trust-region ratio against the proximal policy;
    w corrects for the behaviour policy that sampled the tokens (`correction`, default:
    min(exp(prox_logp - behav_logp), importance_cap) per token). L by `mode`:
    "vanilla": max(-r A, -clip(r, 1-lo, 1+hi) A) (log-ratio clamped to [-20, 20]);
    "dual-clip": vanilla, and for A < 0 at most -clip_ratio_c * A (Ye et al. 2020);
    "gspo": vanilla with r the sequence's geometric-mean ratio (Zheng et al. 2025);
    "cispo": -sg(clip(r, 1-lo, 1+hi)) * A * logp (MiniMax-M1), every token keeps a gradient.
    Only `logp_BT` receives gradient. Metrics: clip_fraction, dual_clip_fraction (dual-clip
    only), ratio_max, kl_behaviour_proximal (see `behaviour_proximal_kl`) and the correction's
    (importance_weight_mean / _max, truncated_fraction, masked_fraction, behaviour_proximal_abs_diff).
    """
    if mode not in POLICY_LOSS_MODES:
        raise ValueError(f"unknown policy loss mode {mode!r}; valid: {', '.join(POLICY_LOSS_MODES)}")
    prox_logp_BT, behav_logp_BT, adv_BT = prox_logp_BT.detach(), behav_logp_BT.detach(), adv_BT.detach()
    c = correction or ISCorrection(cap=importance_cap)
    weight_BT, metrics = importance_weights(prox_logp_BT, behav_logp_BT, mask_BT, c)
    loss_BT, ratio_BT, mode_metrics = _surrogate(
        mode, logp_BT, prox_logp_BT, adv_BT, mask_BT, (clip_low, clip_high, clip_ratio_c)
    )
    loss = aggregate(
        weight_BT * loss_BT, mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_tokens=norm_tokens
    )
    with torch.no_grad():
        metrics.update(mode_metrics, ratio_max=masked_max(ratio_BT, mask_BT))
        metrics["kl_behaviour_proximal"] = behaviour_proximal_kl(prox_logp_BT, behav_logp_BT, mask_BT)
    return loss, metrics


def behaviour_proximal_kl(prox_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor) -> float:
    """KL(behav || prox) over the masked tokens, which the behaviour policy sampled: the mean
    of k3 = r - 1 - log r with r = exp(prox_logp - behav_logp). Its expectation under the
    behaviour policy is exactly KL(behav || prox) (E_behav[r] = 1), so the mean over sampled
    tokens is an unbiased estimate of it; never negative. The log-ratio is clamped to
    [-20, 20] against overflow, the result is not (a far token shows in full). This is
    verl's `k3_kl` rollout-correction metric (`compute_offpolicy_metrics`, called by
    `compute_rollout_corr_metrics_from_logprobs`), with the proximal policy as its training
    policy. 0.0 for an empty mask."""
    with torch.no_grad():
        log_r_BT = (prox_logp_BT - behav_logp_BT).float().clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        # expm1 keeps precision when the ratio is close to 1, where k3 is tiny.
        return float(masked_mean(torch.expm1(log_r_BT) - log_r_BT, mask_BT))


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
