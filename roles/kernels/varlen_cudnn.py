"""cuDNN's varlen attention for packed micro-batches (`trainer.attention_kernel=cudnn`).

The same contract as roles/kernels/varlen.py's backend (one packed row, `cu_seq_lens_q`,
causal within each sequence), registered with transformers as `VARLEN_CUDNN_ATTENTION`
("tandem_varlen_cudnn"). On CUDA with fp16/bf16 inputs the forward and backward are cuDNN's
fused attention on ragged `[T, H, D]` tensors, through PyTorch's own entry points
(`aten._cudnn_attention_forward/backward` with cumulative sequence lengths; GQA native: K and V
keep their heads); anything else (CPU, fp32) takes roles/kernels/varlen.py's path unchanged.
Needs cuDNN 9 (torch's CUDA wheels bundle it).

The kernels run as two opaque custom ops (`tandem::cudnn_varlen`, `tandem::cudnn_varlen_backward`,
roles/kernels/varlen_ops.py) with fake implementations, so `trainer.compile` traces them (the
aten ops have no fake kernel for the varlen case). The forward's log-sum-exp crosses between
them as float32 `[H, T]`, the layout the fake promises; `_lse_to_heads_first` and
`_lse_for_backward` convert from and to whatever this torch's cuDNN path gives and takes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from roles.kernels.varlen_ops import packed_attention_op, transformers_backend

VARLEN_CUDNN_ATTENTION = "tandem_varlen_cudnn"
_tokens_first = False  # whether this torch's cuDNN forward gives the log-sum-exp as [T, H] or [T, H, 1]
_trailing_one = False  # ... with a trailing dimension of 1


def _lse_to_heads_first(lse: Tensor, heads: int, tokens: int) -> Tensor:
    """cuDNN's log-sum-exp as float32 `[H, T]` (torch gives `[H, T]`, or `[T, H(, 1)]` in
    some versions); remembers which for `_lse_for_backward` (one layout per process: the
    torch build decides it, not the batch)."""
    global _tokens_first, _trailing_one
    shape = tuple(lse.shape)
    if shape == (heads, tokens):
        _tokens_first = _trailing_one = False
        return lse
    if shape in ((tokens, heads), (tokens, heads, 1)):
        _tokens_first, _trailing_one = True, len(shape) == 3
        return lse.reshape(tokens, heads).t().contiguous()
    raise RuntimeError(f"cuDNN varlen attention: log-sum-exp of shape {shape} for {heads} heads, {tokens} tokens")


def _lse_for_backward(lse_HT: Tensor) -> Tensor:
    """The log-sum-exp back in the layout the forward gave."""
    if not _tokens_first:
        return lse_HT
    lse_TH = lse_HT.t().contiguous()
    return lse_TH.unsqueeze(-1) if _trailing_one else lse_TH


def _cudnn_forward(
    q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float
) -> tuple[Tensor, Tensor]:
    """Causal varlen attention: (`out` `[T, H, D]`, `lse` float32 `[H, T]`)."""
    out, lse, *_ = torch.ops.aten._cudnn_attention_forward(
        q_THD, k_THD, v_THD, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
    )
    return out, _lse_to_heads_first(lse, q_THD.shape[1], q_THD.shape[0])


def _cudnn_backward(
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
    unused = torch.zeros((), dtype=torch.long, device=q_THD.device)  # dropout's seed and offset: no dropout
    dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
        g_out,
        q_THD,
        k_THD,
        v_THD,
        out,
        _lse_for_backward(lse),
        unused,
        unused,
        None,
        cu,
        cu,
        max_len,
        max_len,
        0.0,
        True,
        scale=scale,
    )
    return dq, dk, dv


cudnn_varlen = packed_attention_op("cudnn_varlen", _cudnn_forward, _cudnn_backward)


# transformers' attention signature, as roles/kernels/varlen.py's `varlen_attention_forward`
# (which serves whatever this kernel does not: off CUDA, fp32, a call without the packing),
# and its registration with transformers (idempotent; returns VARLEN_CUDNN_ATTENTION)
cudnn_attention_forward, register_cudnn_attention = transformers_backend(VARLEN_CUDNN_ATTENTION, cudnn_varlen)


def refuse_where_it_crashes(device: torch.device) -> None:
    """Raise (one line) on a GPU where this kernel is known to crash: on an H100 80GB its first
    step died with "CUDA error: an illegal memory access" at fixed 4k tokens and on the length
    mix (benchmarks/trainer.py --variant cudnn, torch 2.11, cuDNN 9; it runs on the H200)."""
    if device.type == "cuda" and "H100" in torch.cuda.get_device_name(device):
        raise RuntimeError(
            "trainer.attention_kernel=cudnn is refused on an H100: its varlen cuDNN attention died there with "
            "'CUDA error: an illegal memory access' (torch 2.11, cuDNN 9); use trainer.attention_kernel=torch"
        )
