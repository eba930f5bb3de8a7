"""cuDNN's varlen attention for packed micro-batches (`trainer.attention_kernel=cudnn`).

The same contract as roles/training/varlen.py's backend (one packed row, `cu_seq_lens_q`,
causal within each sequence), registered with transformers as `VARLEN_CUDNN_ATTENTION`
("tandem_varlen_cudnn"). On CUDA with fp16/bf16 inputs the forward and backward are cuDNN's
fused attention on ragged `[T, H, D]` tensors, through PyTorch's own entry points
(`aten._cudnn_attention_forward/backward` with cumulative sequence lengths; GQA native: K and V
keep their heads); anything else (CPU, fp32) takes roles/training/varlen.py's path unchanged.
Needs cuDNN 9 (torch's CUDA wheels bundle it).

The kernels run as two opaque custom ops (`tandem::cudnn_varlen`, `tandem::cudnn_varlen_backward`)
with fake implementations, so `trainer.compile` traces them (the aten ops have no fake kernel
for the varlen case). The forward's log-sum-exp crosses between them as float32 `[H, T]`, the
layout the fake promises; `_lse_to_heads_first` / `_lse_for_backward` convert from and to
whatever this torch's cuDNN path gives and takes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from roles.training.varlen import packed_cuda_backend

VARLEN_CUDNN_ATTENTION = "tandem_varlen_cudnn"
_native_lse_shape: dict[tuple[int, int], tuple[int, ...]] = {}  # (H, T) -> the shape cuDNN's forward gave


def _lse_to_heads_first(lse: Tensor, heads: int, tokens: int) -> Tensor:
    """cuDNN's log-sum-exp as float32 `[H, T]` (torch gives `[H, T]`, or `[T, H(, 1)]` in
    some versions); remembers the original shape for the backward."""
    _native_lse_shape[(heads, tokens)] = tuple(lse.shape)
    if tuple(lse.shape) == (heads, tokens):
        return lse
    if lse.numel() == heads * tokens and lse.shape[0] == tokens:
        return lse.reshape(tokens, heads).t().contiguous()
    shape = tuple(lse.shape)
    raise RuntimeError(f"cuDNN varlen attention: log-sum-exp of shape {shape} for {heads} heads, {tokens} tokens")


def _lse_for_backward(lse_HT: Tensor) -> Tensor:
    heads, tokens = lse_HT.shape
    native = _native_lse_shape.get((heads, tokens), (heads, tokens))
    if native == (heads, tokens):
        return lse_HT
    return lse_HT.t().contiguous().reshape(native)


@torch.library.custom_op("tandem::cudnn_varlen", mutates_args=())
def cudnn_varlen(
    q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float
) -> tuple[Tensor, Tensor]:
    """Causal varlen attention: (`out` `[T, H, D]`, `lse` float32 `[H, T]`)."""
    out, lse, *_ = torch.ops.aten._cudnn_attention_forward(
        q_THD, k_THD, v_THD, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
    )
    return out, _lse_to_heads_first(lse, q_THD.shape[1], q_THD.shape[0])


@cudnn_varlen.register_fake
def _(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float) -> tuple[Tensor, Tensor]:
    lse = q_THD.new_empty((q_THD.shape[1], q_THD.shape[0]), dtype=torch.float32)
    return torch.empty_like(q_THD), lse


@torch.library.custom_op("tandem::cudnn_varlen_backward", mutates_args=())
def cudnn_varlen_backward(
    q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, out: Tensor, lse: Tensor, g_out: Tensor, cu: Tensor, max_len: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv) of `cudnn_varlen` for the output gradient `g_out`."""
    unused = torch.zeros((), dtype=torch.long, device=q_THD.device)  # dropout's seed and offset: no dropout
    dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
        g_out, q_THD, k_THD, v_THD, out, _lse_for_backward(lse), unused, unused, None, cu, cu, max_len, max_len,
        0.0, True, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


@cudnn_varlen_backward.register_fake
def _(
    q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, out: Tensor, lse: Tensor, g_out: Tensor, cu: Tensor, max_len: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(q_THD), torch.empty_like(k_THD), torch.empty_like(v_THD)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu, max_len, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu)
    ctx.max_len, ctx.scale = max_len, scale


def _backward(ctx: Any, g_out: Tensor, g_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, cu = ctx.saved_tensors  # lse feeds nothing downstream: its gradient is None
    dq, dk, dv = cudnn_varlen_backward(q, k, v, out, lse, g_out.contiguous(), cu, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None


cudnn_varlen.register_autograd(_backward, setup_context=_setup)


def _cudnn_packed(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    return cudnn_varlen(q_THD, k_THD, v_THD, cu, max_len, scale)[0]


# transformers' attention signature, as roles/training/varlen.py's `varlen_attention_forward`
# (which serves whatever this kernel does not: off CUDA, fp32, a call without the packing)
cudnn_attention_forward = packed_cuda_backend(_cudnn_packed)


def register_cudnn_attention() -> str:
    """Register the backend with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_CUDNN_ATTENTION, cudnn_attention_forward)
    return VARLEN_CUDNN_ATTENTION
