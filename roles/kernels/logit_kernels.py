"""The per-chunk math of the chunked LM head (roles/kernels/token_stats.py), fused where it runs.

A chunk is `C` positions of `[C, V]` logits in the compute dtype (bf16 under FSDP2's mixed
precision). `stats_of_logits` turns them into the sampled token's logprob, the entropy and
the logsumexp; `grad_of_logits` turns the upstream gradients of the first two into the
logits' gradient. Both compute in float32 whatever the logits' dtype.

Compiled (`trainer.compile=true`, with the transformer blocks) both are `torch.compile`d,
dynamic in `C`: inductor fuses the cast, the max, the exp, the sums and the gather into
reductions that read the logits a couple of times and write no float32 `[C, V]` tensor.
Eagerly they hold at most two float32 `[C, V]` tensors (the same code: the CPU tests check
the math that is compiled). `add_weight_grad` sums a chunk's head-weight gradient into a
float32 accumulator: inside the GEMM on CUDA where torch has `addmm(..., out_dtype=float32)`
(checked once per device), else as a GEMM, a cast and an add.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def stats_of_logits(logits_CV: Tensor, t_C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logprob of `t_C`, entropy, logsumexp) per row, float32 `[C]` each. May overwrite
    `logits_CV` (pass a temporary): eagerly, nothing larger than two float32 `[C, V]`."""
    x_CV = logits_CV.float()
    max_C = x_CV.amax(dim=-1)
    x_CV.sub_(max_C.unsqueeze(-1))
    exp_CV = x_CV.exp()
    sum_C = exp_CV.sum(-1)
    target_C = x_CV.gather(-1, t_C.unsqueeze(-1)).squeeze(-1)
    # sum_i p_i l_i = (sum_i e_i l_i) / sum_i e_i, on the shifted logits
    mean_logit_C = exp_CV.mul_(x_CV).sum(-1) / sum_C
    shifted_lse_C = sum_C.log()
    return target_C - shifted_lse_C, shifted_lse_C - mean_logit_C, shifted_lse_C + max_C


def grad_of_logits(
    logits_CV: Tensor,
    t_C: Tensor,
    lse_C: Tensor,
    entropy_C: Tensor,
    g_logp_C: Tensor | None,
    g_entropy_C: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """d(loss)/d(logits) `[C, V]` in `dtype`, given the upstream gradients of the logprob
    and the entropy (None: no gradient; not both) and what `stats_of_logits` returned. May
    overwrite `logits_CV`.

    d logp / d l = onehot(t) - p; d H / d l_j = -p_j (l_j - sum_i p_i l_i), and
    sum_i p_i l_i = lse - H; so g_l = p * coef + g_logp * onehot(t) with
    coef = -g_H (l - (lse - H)) - g_logp."""
    x_CV = logits_CV.float()
    probs_CV = (x_CV - lse_C.unsqueeze(-1)).exp_()
    if g_entropy_C is None:
        assert g_logp_C is not None
        g_CV = probs_CV.mul_(-g_logp_C.float().unsqueeze(-1))
    else:
        coef_CV = x_CV.sub_((lse_C - entropy_C).unsqueeze(-1)).mul_(-g_entropy_C.float().unsqueeze(-1))
        if g_logp_C is not None:
            coef_CV.sub_(g_logp_C.float().unsqueeze(-1))
        g_CV = coef_CV.mul_(probs_CV)
    if g_logp_C is not None:
        g_t_C1 = g_logp_C.float().unsqueeze(-1)
        if torch.compiler.is_compiling():  # one fused pass; a scatter would need the float32 g_CV written
            hit_CV = torch.arange(g_CV.shape[-1], device=g_CV.device).unsqueeze(0) == t_C.unsqueeze(-1)
            g_CV = torch.where(hit_CV, g_CV + g_t_C1, g_CV)
        else:  # no [C, V] temporary
            g_CV.scatter_add_(-1, t_C.unsqueeze(-1), g_t_C1)
    return g_CV.to(dtype)


def chunk_kernel(fn: Callable[..., Any], compiled: bool) -> Callable[..., Any]:
    """`fn` (`stats_of_logits` or `grad_of_logits`), `torch.compile`d if `compiled` (one
    compilation per function and process, dynamic in the number of rows)."""
    return _compiled(fn) if compiled else fn


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled: Callable[..., Any] = torch.compile(fn, dynamic=True, fullgraph=True)
    return compiled


def add_weight_grad(g_w_VD: Tensor, g_CV: Tensor, h_CD: Tensor) -> None:
    """`g_w_VD` (float32) += g_CV^T h_CD."""
    if g_CV.is_cuda and g_CV.dtype in (torch.bfloat16, torch.float16) and _mm_accumulates_in_fp32(g_CV.device):
        torch.addmm(g_w_VD, g_CV.t(), h_CD, out_dtype=torch.float32, out=g_w_VD)
    else:
        g_w_VD += (g_CV.t() @ h_CD).float()


@functools.cache
def _mm_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether this torch has CUDA's bf16 x bf16 -> fp32 `addmm` (`out_dtype`) and it adds in place."""
    a = torch.ones(2, 3, device=device, dtype=torch.bfloat16)
    acc = torch.ones(3, 3, device=device)
    try:
        torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return bool((acc == 3.0).all())
