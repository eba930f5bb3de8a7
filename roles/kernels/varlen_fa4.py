"""FlashAttention-4's varlen kernels for packed micro-batches (`trainer.attention_kernel=fa4`).

The same contract as roles/kernels/varlen.py's backend (one packed row, `cu_seq_lens_q`,
causal within each sequence), registered with transformers as `VARLEN_FA4_ATTENTION`
("tandem_varlen_fa4"). On CUDA with fp16/bf16 inputs the forward and backward are
flash-attn-4's CuTe DSL kernels (`flash_attn.cute.interface._flash_attn_fwd` /
`_flash_attn_bwd`: FA3-class kernels on Hopper, FA4 on Blackwell; GQA native, no repeat of
K/V); anything else (CPU, fp32) takes roles/kernels/varlen.py's path unchanged.

The kernels run as two opaque custom ops (`tandem::fa4_varlen`, `tandem::fa4_varlen_backward`,
roles/kernels/varlen_ops.py) with fake implementations, so `trainer.compile` traces them
without entering the CuTe DSL (which dynamo cannot trace: it compiles kernels on first call).
The first call of each shape class (dtype, head dims, GQA ratio) JIT-compiles its kernels,
seconds to a minute once per process.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

from roles.kernels.varlen_ops import packed_attention_op, transformers_backend

VARLEN_FA4_ATTENTION = "tandem_varlen_fa4"
FA4_DISTRIBUTION = "flash-attn-4"


@functools.cache
def _interface() -> Any:
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        raise RuntimeError(
            f"trainer.attention_kernel=fa4 needs the {FA4_DISTRIBUTION} package (pip install {FA4_DISTRIBUTION}): {exc}"
        ) from exc
    return interface


def _fa4_forward(
    q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float
) -> tuple[Tensor, Tensor]:
    """Causal varlen attention: (`out` `[T, H, D]`, `lse` float32 `[H, T]`)."""
    result = _interface()._flash_attn_fwd(
        q_THD,
        k_THD,
        v_THD,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        softmax_scale=scale,
        causal=True,
        return_lse=True,
    )
    return result[0], result[1]


def _fa4_backward(
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
    grads = _interface()._flash_attn_bwd(
        q_THD,
        k_THD,
        v_THD,
        out,
        g_out,
        lse,
        softmax_scale=scale,
        causal=True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
    )
    return grads[0], grads[1], grads[2]


fa4_varlen = packed_attention_op("fa4_varlen", _fa4_forward, _fa4_backward)


# transformers' attention signature, as roles/kernels/varlen.py's `varlen_attention_forward`
# (which serves whatever this kernel does not: off CUDA, fp32, a call without the packing),
# and its registration with transformers (idempotent; returns VARLEN_FA4_ATTENTION)
fa4_attention_forward, register_fa4_attention = transformers_backend(VARLEN_FA4_ATTENTION, fa4_varlen)
