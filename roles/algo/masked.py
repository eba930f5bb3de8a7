"""Masked reductions over padded [B, T] batches.

Invariant: only entries where the mask is non-zero contribute, a float mask acts as a
per-token weight, and an all-zero mask gives 0 (never NaN, gradient still attached).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
# The name this module used before the seq-mean-* family; kept as an alias.
AGG_ALIASES = {"seq-mean": "seq-mean-token-mean"}


def _safe_denominator(denom: Tensor | float) -> Tensor | float:
    """`denom` with zeros replaced by 1; callers pair it with a numerator that is then 0."""
    if isinstance(denom, Tensor):
        return torch.where(denom > 0, denom, torch.ones_like(denom))
    return denom if denom > 0 else 1.0


def _num_nonempty_rows(mask_BT: Tensor, dtype: torch.dtype) -> Tensor:
    return (mask_BT != 0).any(-1).sum().to(dtype)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x * mask` over `dim` (all dims when None); `mask` may be bool or float."""
    weighted = x * mask.to(x.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mask-weighted mean of `x` over `dim` (all dims when None); 0 where the mask sums to 0."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / _safe_denominator(count)


def aggregate(
    per_token_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_tokens: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar (S = `num_seqs` or the local count of rows with
    any masked token, N = `num_tokens` or the local masked-token count):

    "token-mean": masked sum / N (DAPO's token-level loss).
    "seq-mean-token-mean" (alias "seq-mean"): sum over rows of each row's masked mean / S (GRPO).
    "seq-mean-token-sum": sum over rows of each row's masked sum / S.
    "seq-mean-token-sum-norm": masked sum / (S * `norm_tokens`), a constant length
    normaliser (Dr. GRPO's MAX_TOKENS; the local row width when None).
    "token-sum": masked sum, not normalised.

    Passing the global counts makes the losses of micro-batches (and ranks) sum to the
    loss of the whole batch. A zero denominator gives 0, not NaN.
    """
    mode = AGG_ALIASES.get(mode, mode)
    dtype = per_token_BT.dtype
    if mode == "token-mean":
        denom = mask_BT.to(dtype).sum() if num_tokens is None else num_tokens
        return masked_sum(per_token_BT, mask_BT) / _safe_denominator(denom)
    if mode == "token-sum":
        return masked_sum(per_token_BT, mask_BT)
    seqs = _num_nonempty_rows(mask_BT, dtype) if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        return masked_mean(per_token_BT, mask_BT, dim=-1).sum() / _safe_denominator(seqs)
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token_BT, mask_BT) / _safe_denominator(seqs)
    if mode == "seq-mean-token-sum-norm":
        length = float(per_token_BT.shape[-1]) if norm_tokens is None else norm_tokens
        return masked_sum(per_token_BT, mask_BT) / _safe_denominator(seqs * length)
    valid = ", ".join([*AGG_MODES, *AGG_ALIASES])
    raise ValueError(f"unknown aggregation mode {mode!r}; valid: {valid}")


def masked_max(x: Tensor, mask: Tensor) -> float:
    """Largest `x` where the mask is non-zero, as a python float; 0.0 when the mask is empty."""
    selected = x.detach()[mask != 0]
    return float(selected.max()) if selected.numel() else 0.0
