"""Per-token logprobs and entropy straight from the last hidden state and the LM head.

`chunked_token_stats(hidden_TD, weight_VD, targets_T, chunk)` computes, for every position,
log softmax(h W^T)[target] and the entropy of softmax(h W^T), in float32, `chunk`
positions at a time: it never holds more than one chunk's `[chunk, V]` logits, in forward
or in backward (backward recomputes each chunk's logits, the price is one more matmul; on
CUDA the float32 math is fused into reductions over them, roles/kernels/logit_kernels.py).
Values and gradients equal `token_logprobs` / `entropy_from_logits` of the full logits
(the tests check it in float32).

`TokenStatsHead` is the module the actor engine puts in place of the HF model's `lm_head`
(same `weight` Parameter, so tying, FSDP2 sharding and HF names are unchanged). Inside
`head.targets(targets_BT)` the model's "logits" output is `[B, T, 2]`: (logprob, entropy)
per position; outside it the head is a plain linear layer. Computing the stats inside the
model's own forward keeps FSDP2's all-gather and reduce-scatter of the head weight where
FSDP2 expects them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from roles.kernels.logit_kernels import add_weight_grad, chunk_kernel, grad_of_logits, stats_of_logits


class _ChunkedTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_TD: Tensor, w_VD: Tensor, t_T: Tensor, chunk: int, compiled: bool) -> tuple[Tensor, Tensor]:
        logp_T = torch.empty(h_TD.shape[0], dtype=torch.float32, device=h_TD.device)
        entropy_T, lse_T = torch.empty_like(logp_T), torch.empty_like(logp_T)
        stats = chunk_kernel(stats_of_logits, compiled)
        with torch.no_grad():
            for s in range(0, h_TD.shape[0], chunk):
                out = stats(h_TD[s : s + chunk] @ w_VD.t(), t_T[s : s + chunk])
                logp_T[s : s + chunk], entropy_T[s : s + chunk], lse_T[s : s + chunk] = out
        ctx.save_for_backward(h_TD, w_VD, t_T, lse_T, entropy_T)
        ctx.set_materialize_grads(False)
        ctx.chunk, ctx.compiled = chunk, compiled
        return logp_T, entropy_T

    @staticmethod
    def backward(ctx: Any, g_logp_T: Tensor | None, g_entropy_T: Tensor | None) -> tuple[Tensor | None, ...]:
        if g_logp_T is None and g_entropy_T is None:
            return None, None, None, None, None
        h_TD, w_VD, t_T, lse_T, entropy_T = ctx.saved_tensors
        chunk = ctx.chunk
        g_h_TD = torch.empty(h_TD.shape, dtype=h_TD.dtype, device=h_TD.device) if ctx.needs_input_grad[0] else None
        g_w_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if ctx.needs_input_grad[1] else None
        grad = chunk_kernel(grad_of_logits, ctx.compiled)
        for s in range(0, h_TD.shape[0], chunk):
            e = s + chunk
            h_CD = h_TD[s:e]
            g_CV = grad(
                h_CD @ w_VD.t(),  # the chunk's logits, recomputed
                t_T[s:e],
                lse_T[s:e],
                entropy_T[s:e],
                None if g_logp_T is None else g_logp_T[s:e],
                None if g_entropy_T is None else g_entropy_T[s:e],
                h_TD.dtype,
            )
            if g_h_TD is not None:
                torch.mm(g_CV, w_VD, out=g_h_TD[s:e])
            if g_w_VD is not None:
                add_weight_grad(g_w_VD, g_CV, h_CD)
        return g_h_TD, None if g_w_VD is None else g_w_VD.to(w_VD.dtype), None, None, None


def chunked_token_stats(
    hidden_TD: Tensor, weight_VD: Tensor, targets_T: Tensor, chunk: int, *, compiled: bool = False
) -> tuple[Tensor, Tensor]:
    """(logprob of `targets_T`, entropy) per position, float32 `[T]` each, from `hidden_TD`
    and the head `weight_VD`, `chunk` positions at a time (`chunk` >= 1); the per-chunk math
    `torch.compile`d if `compiled` (roles/kernels/logit_kernels.py)."""
    out: tuple[Tensor, Tensor] = _ChunkedTokenStats.apply(hidden_TD, weight_VD, targets_T.long(), chunk, compiled)
    return out


class TokenStatsHead(nn.Module):
    """A bias-free LM head that returns (logprob, entropy) `[B, T, 2]` inside `targets`."""

    def __init__(self, weight: nn.Parameter, chunk: int, *, compiled: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.chunk, self.compiled = chunk, compiled
        self._targets: Tensor | None = None

    @contextmanager
    def targets(self, targets_BT: Tensor) -> Iterator[None]:
        """Within this block the model's logits output is (logprob of `targets_BT`, entropy)."""
        self._targets = targets_BT
        try:
            yield
        finally:
            self._targets = None

    def forward(self, hidden_BTD: Tensor) -> Tensor:
        if self._targets is None:
            return hidden_BTD @ self.weight.t()
        B, T, D = hidden_BTD.shape
        logp, entropy = chunked_token_stats(
            hidden_BTD.reshape(B * T, D),
            self.weight,
            self._targets.reshape(B * T),
            self.chunk,
            compiled=self.compiled,
        )
        return torch.stack([logp.view(B, T), entropy.view(B, T)], dim=-1)  # a new tensor, not a view


def install_token_stats_head(model: nn.Module, chunk: int, *, compiled: bool = False) -> TokenStatsHead:
    """Replace the HF causal LM's `lm_head` (bias-free linear) by a `TokenStatsHead` sharing
    its weight (its chunk math compiled if `compiled`); call before FSDP wrapping. Returns
    the new head."""
    old = getattr(model, "lm_head", None)
    if not isinstance(old, nn.Linear):
        raise ValueError(f"trainer.logprob_chunk_tokens: {type(model).__name__} has no linear lm_head; set it to 0")
    if old.bias is not None:
        raise ValueError("trainer.logprob_chunk_tokens: the model's lm_head has a bias; set it to 0 (full logits)")
    head = TokenStatsHead(old.weight, chunk, compiled=compiled)
    model.lm_head = head
    return head
