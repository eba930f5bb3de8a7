"""Masked reductions over padded [B, T] batches.

Invariant: only entries where the mask is non-zero contribute, a float mask acts as a
per-token weight, and an all-zero mask gives 0 (never NaN, gradient still attached).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean")


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
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    "token-mean": masked sum / (`num_tokens` or the local masked-token count).
    "seq-mean": sum of per-row masked means / (`num_seqs` or the local count of rows with
    any masked token). Passing the global counts makes the losses of micro-batches (and
    ranks) sum to the loss of the whole batch. A zero denominator gives 0, not NaN.
    """
    if mode == "token-mean":
        denom = mask_BT.to(per_token_BT.dtype).sum() if num_tokens is None else num_tokens
        return masked_sum(per_token_BT, mask_BT) / _safe_denominator(denom)
    if mode == "seq-mean":
        row_mean_B = masked_mean(per_token_BT, mask_BT, dim=-1)
        denom = _num_nonempty_rows(mask_BT, per_token_BT.dtype) if num_seqs is None else num_seqs
        return row_mean_B.sum() / _safe_denominator(denom)
    raise ValueError(f"unknown aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}")


def masked_max(x: Tensor, mask: Tensor) -> float:
    """Largest `x` where the mask is non-zero, as a python float; 0.0 when the mask is empty."""
    selected = x.detach()[mask != 0]
    return float(selected.max()) if selected.numel() else 0.0
