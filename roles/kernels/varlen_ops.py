"""Opaque custom ops for a packed varlen attention kernel with its own backward.

`packed_attention_op(name, forward, backward)` defines `tandem::NAME` and
`tandem::NAME_backward` around two plain functions, with fake kernels of the real shapes and
the autograd wiring between them, and returns the forward op. `trainer.compile` traces such
an op as one node without entering the kernel (which dynamo may not trace: a DSL compiling
kernels on first call, an aten op with no fake kernel for the varlen case). The forward
returns (`out` `[T, H, D]`, `lse` float32 `[H, T]`); the backward gets them back with the
output's gradient and returns (dq, dk, dv) of q/k/v's shapes (GQA: k and v may have fewer
heads). `transformers_backend(backend, op)` puts such an op behind transformers' attention
signature, with roles/kernels/varlen.py's path for whatever it does not serve.
roles/kernels/varlen_fa4.py and roles/kernels/varlen_cudnn.py use both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from roles.kernels.varlen import varlen_attention_forward

# (q, k, v `[T, H, D]`, cu int32 `[N + 1]`, longest, scale) -> (out `[T, H, D]`, lse float32 `[H, T]`)
Forward = Callable[[Tensor, Tensor, Tensor, Tensor, int, float], tuple[Tensor, Tensor]]
# (q, k, v, out, lse, g_out, cu, longest, scale) -> (dq, dk, dv)
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, float], tuple[Tensor, Tensor, Tensor]]


def packed_attention_op(name: str, forward: Forward, backward: Backward) -> Any:
    """The forward custom op `tandem::name` (call it as `forward`), differentiable through
    `tandem::name_backward`."""

    @torch.library.custom_op(f"tandem::{name}", mutates_args=())
    def op(
        q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float
    ) -> tuple[Tensor, Tensor]:
        return forward(q_THD, k_THD, v_THD, cu, max_len, scale)

    @op.register_fake
    def _(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float) -> tuple[Tensor, Tensor]:
        lse = q_THD.new_empty((q_THD.shape[1], q_THD.shape[0]), dtype=torch.float32)
        return torch.empty_like(q_THD), lse

    @torch.library.custom_op(f"tandem::{name}_backward", mutates_args=())
    def op_backward(
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        out: Tensor,
        lse: Tensor,
        g_out: Tensor,
        cu: Tensor,
        max_len: int,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return backward(q_THD, k_THD, v_THD, out, lse, g_out, cu, max_len, scale)

    @op_backward.register_fake
    def _(
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        out: Tensor,
        lse: Tensor,
        g_out: Tensor,
        cu: Tensor,
        max_len: int,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return torch.empty_like(q_THD), torch.empty_like(k_THD), torch.empty_like(v_THD)

    def setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, cu, max_len, scale = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], cu)
        ctx.max_len, ctx.scale = max_len, scale

    def grads(ctx: Any, g_out: Tensor, g_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, cu = ctx.saved_tensors  # lse feeds nothing downstream: its gradient is None
        dq, dk, dv = op_backward(q, k, v, out, lse, g_out.contiguous(), cu, ctx.max_len, ctx.scale)
        return dq, dk, dv, None, None, None

    op.register_autograd(grads, setup_context=setup)
    return op


def transformers_backend(backend: str, op: Any) -> tuple[Callable[..., tuple[Tensor, None]], Callable[[], str]]:
    """For a forward op of `packed_attention_op`: (the transformers attention function that
    runs it on CUDA fp16/bf16 packed rows and roles/kernels/varlen.py's
    `varlen_attention_forward` on everything else: CPU, fp32, a call without the packing; so
    the kernel keeps that module's contract and its CPU path value for value), and a function
    registering that as attention implementation `backend` and returning the name (idempotent)."""

    def attention_forward(
        module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
    ) -> tuple[Tensor, None]:
        cu, max_len, scaling = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"), kwargs.get("scaling")
        half = query.dtype in (torch.float16, torch.bfloat16)
        if not (query.is_cuda and half) or cu is None or max_len is None or query.shape[0] != 1:
            return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        q_THD, k_THD, v_THD = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        out_THD, _ = op(q_THD, k_THD, v_THD, cu.int(), int(max_len), scale)
        return out_THD.unsqueeze(0), None

    def register() -> str:
        from transformers import AttentionInterface

        AttentionInterface.register(backend, attention_forward)
        return backend

    return attention_forward, register
