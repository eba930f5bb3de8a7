"""roles/critic/value_rows.py `unpad_rows`: a micro-batch's right-padded value rows land in the
flat per-token tensor at their sequences' spans, and rows past the spans are dropped."""

from __future__ import annotations

import torch

from roles.critic.value_rows import unpad_rows


def test_rows_land_at_their_spans_and_padding_rows_are_dropped() -> None:
    spans = [(0, 2), (2, 5), (5, 6)]
    out = torch.zeros(6)
    first = torch.tensor([[1.0, 2.0, -1.0], [3.0, 4.0, 5.0]])  # sequence 0 padded by one
    assert unpad_rows(first, spans, 0, out) == 2
    second = torch.tensor([[6.0, -1.0, -1.0]])
    assert unpad_rows(second, spans, 2, out) == 3
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert unpad_rows(torch.full((1, 3), 9.0), spans, 3, out) == 3  # a padding micro-batch: nothing written
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
