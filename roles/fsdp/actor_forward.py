"""One forward of a causal LM over a micro-batch → per-token logprobs and entropy, [B, T - 1].

`setup_actor_model` loads the HF model the way the actor's options ask: the varlen
attention backend when packing (roles/kernels/varlen.py), a `TokenStatsHead` when the
logprobs are chunked (roles/kernels/token_stats.py). `token_stats(model, mb, ...)` then
runs it on a padded or a packed `MicroBatch` and returns the same thing either way:
`logp[i, j]` is the logprob of sequence i's token j + 1 given its tokens up to j, in the
padded layout of `mb.fields` shifted by one (values at padding are arbitrary; mask them).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from roles.algo import entropy_from_logits, token_logprobs
from roles.fsdp.wrap import find_blocks
from roles.kernels.block_kernels import apply_kernels
from roles.kernels.token_stats import TokenStatsHead, install_token_stats_head
from roles.kernels.varlen import register_varlen_attention
from roles.kernels.varlen_cudnn import refuse_where_it_crashes, register_cudnn_attention
from roles.kernels.varlen_fa4 import register_fa4_attention
from roles.training.hf_loading import load_causal_lm
from roles.training.microbatch import MicroBatch

_PACKED_BACKENDS = {
    "torch": register_varlen_attention,
    "fa4": register_fa4_attention,
    "cudnn": register_cudnn_attention,
}


def setup_actor_model(
    model_path: Path,
    dtype: torch.dtype,
    device: torch.device,
    *,
    packing: bool,
    chunk: int,
    gradient_checkpointing: bool = False,
    compile_blocks: bool = False,
    kernels: str = "torch",
    attention_kernel: str = "torch",
) -> torch.nn.Module:
    """The HF model for `token_stats`, not yet FSDP-wrapped; `chunk` 0 keeps the full logits;
    `compile_blocks` compiles each transformer block in place (names and weights unchanged)
    and the chunked head's per-chunk math; `kernels` (roles/kernels/block_kernels.py) are put in
    before either; `attention_kernel` "fa4" packs through flash-attn-4's kernels
    (roles/kernels/varlen_fa4.py), "cudnn" through cuDNN's (roles/kernels/varlen_cudnn.py),
    instead of PyTorch's varlen FlashAttention-2."""
    attn = "sdpa"
    if packing:
        if attention_kernel == "cudnn":
            refuse_where_it_crashes(device)
        attn = _PACKED_BACKENDS[attention_kernel]()
    model = load_causal_lm(
        model_path, dtype, device, gradient_checkpointing=gradient_checkpointing, attn_implementation=attn
    )
    apply_kernels(model, kernels)
    if chunk > 0:
        install_token_stats_head(model, chunk, compiled=compile_blocks)
    if compile_blocks:
        for block in find_blocks(model):
            block.compile(dynamic=True)
    return model


def token_stats(model: torch.nn.Module, mb: MicroBatch, *, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """(logp, entropy) `[B, T - 1]` float32; entropy keeps its graph only if `entropy_grad`.
    A packed `mb` needs a model from `setup_actor_model(..., packing=True)`."""
    head = getattr(model, "lm_head", None)
    if mb.packed is not None:
        p = mb.packed
        logp_1P, entropy_1P = _stats(model, head, p.input_ids_1P, p.model_inputs(), entropy_grad)
        return logp_1P[0][p.gather_BL], entropy_1P[0][p.gather_BL]
    ids = mb.input_ids_BT
    inputs: dict[str, object] = {"input_ids": ids, "attention_mask": mb.attention_mask_BT}
    logp, entropy = _stats(model, head, ids, inputs, entropy_grad)
    return logp[:, :-1], entropy[:, :-1]


def _stats(
    model: torch.nn.Module, head: torch.nn.Module | None, ids: Tensor, inputs: dict[str, object], entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    """Stats at every position of `ids`' rows, the target being the next id of the row (the
    last position's target wraps around and is meaningless). No KV cache: HF's default
    `use_cache` would fill one in every layer (and recompile each compiled block)."""
    targets = torch.roll(ids, -1, dims=1)
    inputs = {**inputs, "use_cache": False}
    if isinstance(head, TokenStatsHead):
        with head.targets(targets):
            out = model(**inputs).logits
        logp, entropy = out[..., 0], out[..., 1]
        return logp, entropy if entropy_grad else entropy.detach()
    logits = model(**inputs).logits
    logp = token_logprobs(logits, targets)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits)
    return logp, entropy
