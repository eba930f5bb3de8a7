"""Megatron's routers see a micro-batch's rows sequence-first: `sequence_first` reorders
per-row routing given in the model input's batch-first order (roles/megatron/moe.py)."""

from __future__ import annotations

import torch

from roles.megatron.moe import sequence_first


def test_sequence_first_puts_row_b_t_at_t_times_b_plus_b() -> None:
    B, T = 3, 4
    rows = torch.arange(B * T)  # row b * T + t
    out = sequence_first(rows, B, T)
    for b in range(B):
        for t in range(T):
            assert int(out[t * B + b]) == b * T + t


def test_sequence_first_keeps_trailing_dims() -> None:
    experts = torch.arange(2 * 5 * 3 * 2).view(2 * 5, 3, 2)
    out = sequence_first(experts, 2, 5)
    assert out.shape == experts.shape
    assert torch.equal(out[1 * 2 + 1], experts[1 * 5 + 1]) and torch.equal(out[4 * 2 + 0], experts[4])
