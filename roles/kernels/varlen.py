"""Variable-length attention for packed micro-batches, as a transformers attention backend.

`register_varlen_attention()` registers `VARLEN_ATTENTION` ("tandem_varlen") with
transformers' `AttentionInterface`; a model loaded with that `attn_implementation` and called
on one packed row (`input_ids` `[1, T]`, `position_ids` restarting at 0 per sequence) with
`cu_seq_lens_q` (int32 `[N + 1]`) and `max_length_q` attends causally within each
sequence only. transformers builds no mask for a backend it does not know, so no `[T, T]`
mask is ever made. Kernels, same inputs:

* CUDA: `torch.nn.attention.varlen.varlen_attn` (PyTorch's FlashAttention-2 varlen,
  forward and backward; torch >= 2.10), or the CPU path where this torch lacks it
  (`cuda_kernel()` says which), and for fp32 inputs (FlashAttention takes fp16/bf16 only:
  training without mixed precision gets the SDPA path). vLLM's bundled FA3 has no
  backward, so it cannot train.
* CPU: one `scaled_dot_product_attention(is_causal=True)` per sequence. Equal to the
  padded path's masked SDPA up to float rounding; the tests compare them. Inside a compiled
  block it runs as one custom op (`tandem::sdpa_per_sequence`, backward by recomputing),
  so the CPU traces the graph CUDA traces.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

VARLEN_ATTENTION = "tandem_varlen"


@functools.cache
def cuda_kernel() -> str:
    """The kernel CUDA tensors get: "varlen_attn" (PyTorch's FA2 varlen) where this torch
    has it, else "sdpa_per_sequence" (the CPU path, on CUDA: correct, more launches)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return "sdpa_per_sequence"
    return "varlen_attn"


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _cuda_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - q_THD.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no scale argument; the model needs {scale}")
    if "window_size" in params:  # torch > 2.10 spells causal as a window; a tuple: it tests `== (-1, 0)`
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if q_THD.shape[1] != k_THD.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            groups = q_THD.shape[1] // k_THD.shape[1]
            k_THD, v_THD = k_THD.repeat_interleave(groups, dim=1), v_THD.repeat_interleave(groups, dim=1)
    out = varlen_attn(q_THD, k_THD, v_THD, cu, cu, max_len, max_len, **kw)
    assert isinstance(out, Tensor)  # no return_aux: the output alone
    return out


def _cpu_varlen(q_HTD: Tensor, k_HTD: Tensor, v_HTD: Tensor, cu: list[int], scale: float) -> Tensor:
    sdpa, gqa = F.scaled_dot_product_attention, q_HTD.shape[0] != k_HTD.shape[0]
    outs = [
        sdpa(q_HTD[:, s:e], k_HTD[:, s:e], v_HTD[:, s:e], is_causal=True, scale=scale, enable_gqa=gqa)
        for s, e in itertools.pairwise(cu)
    ]
    return torch.cat(outs, dim=1)  # [H, T, D]


@torch.library.custom_op("tandem::sdpa_per_sequence", mutates_args=())
def _cpu_varlen_op(q_HTD: Tensor, k_HTD: Tensor, v_HTD: Tensor, cu: Tensor, scale: float) -> Tensor:
    """`_cpu_varlen` as one opaque op, so that a compiled block traces it as it traces CUDA's
    `varlen_attn` (no graph break on the sequence boundaries, no guard on them)."""
    return _cpu_varlen(q_HTD, k_HTD, v_HTD, cu.tolist(), scale)


@_cpu_varlen_op.register_fake
def _(q_HTD: Tensor, k_HTD: Tensor, v_HTD: Tensor, cu: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q_HTD)


def _cpu_varlen_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, cu, scale = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale = scale


@torch.library.custom_op("tandem::sdpa_per_sequence_backward", mutates_args=())
def _cpu_varlen_backward_op(
    q_HTD: Tensor, k_HTD: Tensor, v_HTD: Tensor, cu: Tensor, scale: float, g_HTD: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    spans = cu.tolist()  # recompute the forward, then its vector-Jacobian product
    vjp = torch.func.vjp(lambda q, k, v: _cpu_varlen(q, k, v, spans, scale), q_HTD, k_HTD, v_HTD)[1]
    dq, dk, dv = vjp(g_HTD)
    return dq, dk, dv


@_cpu_varlen_backward_op.register_fake
def _(q_HTD: Tensor, k_HTD: Tensor, v_HTD: Tensor, cu: Tensor, scale: float, g_HTD: Tensor) -> tuple[Tensor, ...]:
    return torch.empty_like(q_HTD), torch.empty_like(k_HTD), torch.empty_like(v_HTD)


def _cpu_varlen_backward(ctx: Any, g_HTD: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, cu = ctx.saved_tensors
    return (*_cpu_varlen_backward_op(q, k, v, cu, ctx.scale, g_HTD.contiguous()), None, None)


_cpu_varlen_op.register_autograd(_cpu_varlen_backward, setup_context=_cpu_varlen_setup)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: q/k/v `[1, H, T, D]` → (`[1, T, H, D]`, None)."""
    if query.shape[0] != 1 or cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"{VARLEN_ATTENTION} attention needs one packed row with cu_seq_lens_q and max_length_q")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    half = query.dtype in (torch.float16, torch.bfloat16)  # FlashAttention's dtypes; fp32 takes the SDPA path
    if query.is_cuda and half and cuda_kernel() == "varlen_attn":
        q_THD, k_THD, v_THD = (x.transpose(0, 1).contiguous() for x in (q, k, v))  # copies only if not in that layout
        out_THD = _cuda_varlen(q_THD, k_THD, v_THD, cu_seq_lens_q.int(), int(max_length_q), scale)
    else:
        if torch.compiler.is_compiling():
            out_HTD = _cpu_varlen_op(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, scale)
        else:
            out_HTD = _cpu_varlen(q, k, v, cu_seq_lens_q.tolist(), scale)
        out_THD = out_HTD.transpose(0, 1)
    return out_THD.unsqueeze(0).contiguous(), None


def register_varlen_attention() -> str:
    """Register the backend with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION
