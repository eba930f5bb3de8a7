"""Packed attention inputs for the GPU kernel tests: one row of several causal sequences."""

from __future__ import annotations

import torch

# One long sequence, one of a single token, and others between: the kernels' edge cases.
LENGTHS = [3000, 1, 17, 500, 64, 1200]


def packed_qkv(
    lengths: list[int] = LENGTHS, heads: int = 12, kv_heads: int = 2, dim: int = 128
) -> tuple[torch.Tensor, ...]:
    """(cu int32 `[N + 1]`, q `[1, heads, T, dim]`, k and v `[1, kv_heads, T, dim]`), bf16 on
    GPU 0, requiring grad, seeded (the same tensors every call)."""
    torch.manual_seed(0)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).int()
    T = sum(lengths)
    q = torch.randn(1, heads, T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return cu, q, k, v
