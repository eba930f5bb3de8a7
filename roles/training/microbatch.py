"""Packed sequences → micro-batches under a token budget, padded or packed.

`split_micro_batches` keeps the packed order and starts a new micro-batch whenever
adding the next sequence would make `num_seqs * longest` exceed `budget` (a single
sequence longer than the budget gets a micro-batch of its own). `pack_micro_batches`
bins by real tokens instead (`roles/training/balance.py`) and gives each micro-batch a
`PackedRow`: the model input is one row of the sequences back to back, no padding.

Either way every per-token tensor of `MicroBatch.fields` is [B, T] and right-padded;
`mask_BT` is 0 on padding, prompt tokens and the observation tokens of multi-turn samples
(so they contribute no gradient), and the loss code is the same for both.
Targets are aligned to inputs: position t of a per-token tensor describes token t.
A batch with routed experts (MoE routing replay) gives each micro-batch its `routing`: the
experts [N, layers, top_k] and mask [N] of the N rows the model sees, in the model input's
order (packed: the P tokens back to back; padded: [B, T] flattened, padding masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roles.training.balance import balanced_bins
from transport.wire import TRAIN_BATCH_TOKEN_FIELDS, TrainBatch

# The per-token fields a micro-batch pads to [B, T] (`MicroBatch.fields`): all of a
# TrainBatch's but input_ids, which becomes the model input (`input_ids_BT`, `PackedRow`),
# and the routed experts, which travel in the model input's order (`routing`).
PER_TOKEN = tuple(f for f in TRAIN_BATCH_TOKEN_FIELDS if f not in ("input_ids", "routed_experts", "routed_mask"))


@dataclass
class PackedRow:
    """The model input of a packed micro-batch: `input_ids_1P` / `position_ids_1P` are the
    B sequences back to back (P tokens, positions restarting at 0), `cu_seqlens` int32
    [B + 1] their boundaries, `max_len` the longest. `gather_BL` (int64 [B, T - 1]) maps the
    padded layout's next-token positions to packed positions: the stat at packed position
    `gather_BL[i, j]` is sequence i's prediction of its token j + 1 (0 where j + 1 is padding)."""

    input_ids_1P: torch.Tensor
    position_ids_1P: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    gather_BL: torch.Tensor

    def to(self, device: torch.device) -> PackedRow:
        return PackedRow(
            self.input_ids_1P.to(device),
            self.position_ids_1P.to(device),
            self.cu_seqlens.to(device),
            self.max_len,
            self.gather_BL.to(device),
        )

    def model_inputs(self) -> dict[str, object]:
        """Keyword arguments for an HF causal LM with the varlen attention backend."""
        return dict(
            input_ids=self.input_ids_1P,
            position_ids=self.position_ids_1P,
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_len,
            max_length_k=self.max_len,
        )


@dataclass
class MicroBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    fields: dict[str, torch.Tensor]  # per-token tensors named as in TrainBatch, [B, T]
    packed: PackedRow | None = None  # the model input when packed
    spans: tuple[tuple[int, int], ...] = ()  # row i is the batch's tokens [start, end) of spans[i]
    routing: tuple[torch.Tensor, torch.Tensor] | None = None  # (experts [N, L, k], mask [N]) per model row

    @property
    def num_tokens(self) -> int:
        return int(self.fields["loss_mask"].sum().item()) if "loss_mask" in self.fields else 0

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.input_ids_BT.to(device),
            self.attention_mask_BT.to(device),
            {k: v.to(device) for k, v in self.fields.items()},
            None if self.packed is None else self.packed.to(device),
            self.spans,
            None if self.routing is None else (self.routing[0].to(device), self.routing[1].to(device)),
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
    mbs = [_pad(batch, g) for g in groups]
    for mb in mbs:
        mb.routing = _padded_routing(batch, list(mb.spans), mb.input_ids_BT.shape[1])
    return mbs


def pack_micro_batches(batch: TrainBatch, budget: int, num_bins: int | None = None) -> list[MicroBatch]:
    """Packed micro-batches of at most `budget` real tokens each (a longer sequence gets
    one of its own), length-balanced; `num_bins` forces at least that many (see balance.py)."""
    cu = batch.cu_seqlens.tolist()
    spans = [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    bins = balanced_bins([e - s for s, e in spans], budget, num_bins)
    return [_packed(batch, [spans[i] for i in b]) for b in bins]


def _packed(batch: TrainBatch, spans: list[tuple[int, int]]) -> MicroBatch:
    mb = _pad(batch, spans)
    lengths = torch.tensor([e - s for s, e in spans])
    cu = torch.zeros(len(spans) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    ids = torch.cat([batch.input_ids[s:e] for s, e in spans]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).unsqueeze(0)
    j = torch.arange(mb.input_ids_BT.shape[1] - 1)
    gather = cu[:-1, None].long() + j[None, :]
    gather = torch.where(j[None, :] < (lengths - 1)[:, None], gather, torch.zeros_like(gather))
    mb.packed = PackedRow(ids, positions, cu, int(lengths.max()), gather)
    if batch.routed_experts is not None and batch.routed_mask is not None:
        mb.routing = (
            torch.cat([batch.routed_experts[s:e] for s, e in spans]),
            torch.cat([batch.routed_mask[s:e] for s, e in spans]),
        )
    return mb


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
    return MicroBatch(ids, attn, fields, spans=tuple(spans))


def _padded_routing(
    batch: TrainBatch, spans: list[tuple[int, int]], width: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's routed experts in the padded layout, [B * T, L, k] (mask 0 on padding)."""
    if batch.routed_experts is None or batch.routed_mask is None:
        return None
    experts = torch.zeros((len(spans), width, *batch.routed_experts.shape[1:]), dtype=batch.routed_experts.dtype)
    mask = torch.zeros(len(spans), width, dtype=batch.routed_mask.dtype)
    for row, (start, end) in enumerate(spans):
        experts[row, : end - start] = batch.routed_experts[start:end]
        mask[row, : end - start] = batch.routed_mask[start:end]
    return experts.flatten(0, 1), mask.flatten()


def dummy_micro_batch(batch: TrainBatch) -> MicroBatch:
    """A one-token micro-batch with an all-zero mask: keeps collectives in step on a rank
    that has fewer micro-batches than its peers, contributing nothing to the loss."""
    fields = {name: torch.zeros(1, 1) for name in PER_TOKEN if getattr(batch, name) is not None}
    fields.setdefault("loss_mask", torch.zeros(1, 1))
    return MicroBatch(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.int64), fields)


def dummy_packed_micro_batch(batch: TrainBatch) -> MicroBatch:
    """`dummy_micro_batch` with a one-token packed row."""
    mb = dummy_micro_batch(batch)
    one = torch.zeros(1, 1, dtype=torch.int64)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    mb.packed = PackedRow(one, one.clone(), cu, 1, torch.zeros(1, 0, dtype=torch.int64))
    return mb
