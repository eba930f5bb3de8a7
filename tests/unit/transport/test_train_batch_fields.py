"""`wire.TRAIN_BATCH_TOKEN_FIELDS` is the one list of a TrainBatch's per-token fields: every
tensor field but `cu_seqlens`, so a per-token field added to the struct joins it (and every
site derived from it: mini-batch selection, micro-batch padding, Megatron's shard gather)."""

from __future__ import annotations

import typing

import torch

from roles.training.minibatch import select_sequences
from transport import wire


def test_the_token_fields_are_every_tensor_field_but_cu_seqlens() -> None:
    hints = typing.get_type_hints(wire.TrainBatch)
    tensors = [f for f in wire.TrainBatch.__struct_fields__ if "Tensor" in str(hints[f])]
    assert [f for f in tensors if f != "cu_seqlens"] == list(wire.TRAIN_BATCH_TOKEN_FIELDS)


def test_selecting_every_sequence_keeps_every_token_field() -> None:
    n = 5
    fields = {name: torch.arange(n, dtype=torch.float32) + i for i, name in enumerate(wire.TRAIN_BATCH_TOKEN_FIELDS)}
    batch = wire.TrainBatch(
        step=1, cu_seqlens=torch.tensor([0, 2, 5]), global_num_tokens=n, global_num_seqs=2, **fields
    )
    again = select_sequences(batch, [0, 1])
    for name in wire.TRAIN_BATCH_TOKEN_FIELDS:
        assert torch.equal(getattr(again, name), getattr(batch, name)), name
