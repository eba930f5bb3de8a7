"""Per-token logprobs and entropy straight from the last hidden state and the LM head.

`chunked_token_stats(hidden_TD, weight_VD, targets_T, chunk)` computes, for every position,
log softmax(h W^T)[target] and the entropy of softmax(h W^T), in float32, `chunk`
positions at a time: it never holds more than `[chunk, V]` float32 logits, in forward or
in backward (backward recomputes each chunk's logits, the price is one more matmul).
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


def _chunk_stats(h_CD: Tensor, w_VD: Tensor, t_C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logp_C, entropy_C, lse_C) of one chunk, float32; in-place where it can, as the
    `[C, V]` passes are what this costs."""
    logits_CV = (h_CD @ w_VD.t()).float()
    max_C = logits_CV.max(dim=-1).values
    logits_CV.sub_(max_C.unsqueeze(-1))
    exp_CV = logits_CV.exp()
    sum_C = exp_CV.sum(-1)
    # sum_i p_i l_i = (sum_i e_i l_i) / sum_i e_i, on the shifted logits
    mean_logit_C = torch.bmm(exp_CV.unsqueeze(1), logits_CV.unsqueeze(2)).view(-1) / sum_C
    shifted_lse_C = sum_C.log()
    logp_C = logits_CV.gather(-1, t_C.unsqueeze(-1)).squeeze(-1) - shifted_lse_C
    return logp_C, shifted_lse_C - mean_logit_C, shifted_lse_C + max_C


class _ChunkedTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_TD: Tensor, w_VD: Tensor, t_T: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        logp_T = torch.empty(h_TD.shape[0], dtype=torch.float32, device=h_TD.device)
        entropy_T, lse_T = torch.empty_like(logp_T), torch.empty_like(logp_T)
        with torch.no_grad():
            for s in range(0, h_TD.shape[0], chunk):
                stats = _chunk_stats(h_TD[s : s + chunk], w_VD, t_T[s : s + chunk])
                logp_T[s : s + chunk], entropy_T[s : s + chunk], lse_T[s : s + chunk] = stats
        ctx.save_for_backward(h_TD, w_VD, t_T, lse_T, entropy_T)
        ctx.set_materialize_grads(False)
        ctx.chunk = chunk
        return logp_T, entropy_T

    @staticmethod
    def backward(ctx: Any, g_logp_T: Tensor | None, g_entropy_T: Tensor | None) -> tuple[Tensor | None, ...]:
        h_TD, w_VD, t_T, lse_T, entropy_T = ctx.saved_tensors
        chunk = ctx.chunk
        g_h_TD = torch.zeros_like(h_TD) if ctx.needs_input_grad[0] else None
        g_w_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if ctx.needs_input_grad[1] else None
        for s in range(0, h_TD.shape[0], chunk):
            h_CD, t_C, lse_C = h_TD[s : s + chunk], t_T[s : s + chunk], lse_T[s : s + chunk].unsqueeze(-1)
            coef_CV = (h_CD @ w_VD.t()).float()  # the chunk's logits, recomputed
            probs_CV = (coef_CV - lse_C).exp_()
            # g_l = p * coef (+ g_logp at the target): d logp / d l = onehot - p and
            # d H / d l_j = -p_j (l_j - sum_i p_i l_i), with sum_i p_i l_i = lse - H.
            if g_entropy_T is not None:
                coef_CV.sub_(lse_C - entropy_T[s : s + chunk].unsqueeze(-1))
                coef_CV.mul_(-g_entropy_T[s : s + chunk].float().unsqueeze(-1))
            else:
                coef_CV.zero_()
            if g_logp_T is not None:
                g_C = g_logp_T[s : s + chunk].float()
                coef_CV.sub_(g_C.unsqueeze(-1))
            g_CV = coef_CV.mul_(probs_CV)
            del probs_CV
            if g_logp_T is not None:
                g_CV.scatter_add_(-1, t_C.unsqueeze(-1), g_C.unsqueeze(-1))
            g_CV = g_CV.to(h_TD.dtype)
            if g_h_TD is not None:
                g_h_TD[s : s + chunk] = g_CV @ w_VD
            if g_w_VD is not None:
                g_w_VD += (g_CV.t() @ h_CD).float()
        return g_h_TD, None if g_w_VD is None else g_w_VD.to(w_VD.dtype), None, None


def chunked_token_stats(hidden_TD: Tensor, weight_VD: Tensor, targets_T: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """(logprob of `targets_T`, entropy) per position, float32 `[T]` each, from `hidden_TD`
    and the head `weight_VD`, `chunk` positions at a time (`chunk` >= 1)."""
    out: tuple[Tensor, Tensor] = _ChunkedTokenStats.apply(hidden_TD, weight_VD, targets_T.long(), chunk)
    return out


class TokenStatsHead(nn.Module):
    """A bias-free LM head that returns (logprob, entropy) `[B, T, 2]` inside `targets`."""

    def __init__(self, weight: nn.Parameter, chunk: int) -> None:
        super().__init__()
        self.weight = weight
        self.chunk = chunk
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
            hidden_BTD.reshape(B * T, D), self.weight, self._targets.reshape(B * T), self.chunk
        )
        return torch.stack([logp.view(B, T), entropy.view(B, T)], dim=-1)  # a new tensor, not a view


def install_token_stats_head(model: nn.Module, chunk: int) -> TokenStatsHead:
    """Replace the HF causal LM's `lm_head` (bias-free linear) by a `TokenStatsHead` sharing
    its weight; call before FSDP wrapping. Returns the new head."""
    old = getattr(model, "lm_head", None)
    if not isinstance(old, nn.Linear):
        raise ValueError(f"trainer.logprob_chunk_tokens: {type(model).__name__} has no linear lm_head; set it to 0")
    if old.bias is not None:
        raise ValueError("trainer.logprob_chunk_tokens: the model's lm_head has a bias; set it to 0 (full logits)")
    head = TokenStatsHead(old.weight, chunk)
    model.lm_head = head
    return head
