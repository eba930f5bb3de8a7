"""Packed sequences → padded micro-batches under a token budget.

`split_micro_batches` keeps the packed order and starts a new micro-batch whenever
adding the next sequence would make `num_seqs * longest` exceed `budget` (a single
sequence longer than the budget gets a micro-batch of its own). Every tensor of a
`MicroBatch` is [B, T] and right-padded; `loss_mask` is 0 on padding, prompt tokens and the
observation tokens of multi-turn samples (so they contribute no gradient).
Targets are aligned to inputs: position t of a per-token tensor describes token t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transport.wire import TrainBatch

PER_TOKEN = (
    "loss_mask", "behaviour_logprobs", "advantages", "returns", "old_values", "ref_logprobs", "proximal_logprobs",
)  # fmt: skip


@dataclass
class MicroBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    fields: dict[str, torch.Tensor]  # per-token tensors named as in TrainBatch, [B, T]

    @property
    def num_tokens(self) -> int:
        return int(self.fields["loss_mask"].sum().item()) if "loss_mask" in self.fields else 0

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.input_ids_BT.to(device),
            self.attention_mask_BT.to(device),
            {k: v.to(device) for k, v in self.fields.items()},
        )


def split_micro_batches(batch: TrainBatch, budget: int) -> list[MicroBatch]:
    cu = batch.cu_seqlens.tolist()
    spans = [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    groups: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    longest = 0
    for start, end in spans:
        length = end - start
        if current and (len(current) + 1) * max(longest, length) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append((start, end))
        longest = max(longest, length)
    if current:
        groups.append(current)
    return [_pad(batch, g) for g in groups]


def _pad(batch: TrainBatch, spans: list[tuple[int, int]]) -> MicroBatch:
    T = max(end - start for start, end in spans)
    B = len(spans)
    ids = torch.zeros(B, T, dtype=torch.int64)
    attn = torch.zeros(B, T, dtype=torch.int64)
    fields = {name: torch.zeros(B, T, dtype=torch.float32) for name in PER_TOKEN if getattr(batch, name) is not None}
    for row, (start, end) in enumerate(spans):
        n = end - start
        ids[row, :n] = batch.input_ids[start:end]
        attn[row, :n] = 1
        for name, out in fields.items():
            out[row, :n] = getattr(batch, name)[start:end]
    return MicroBatch(ids, attn, fields)


def dummy_micro_batch(batch: TrainBatch) -> MicroBatch:
    """A one-token micro-batch with an all-zero mask: keeps collectives in step on a rank
    that has fewer micro-batches than its peers, contributing nothing to the loss."""
    fields = {name: torch.zeros(1, 1) for name in PER_TOKEN if getattr(batch, name) is not None}
    fields.setdefault("loss_mask", torch.zeros(1, 1))
    return MicroBatch(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.int64), fields)
