"""The packed layout of a critic's values, what both critic engines (`fsdp_engine`,
`megatron_engine`) share: a `ValueRequest` as a batch to micro-batch, its sequences' spans,
the micro-batches' right-padded rows written back into one flat tensor, and the clipped
value loss of a micro-batch (`clipped_value_loss`).
"""

from __future__ import annotations

import torch

from roles.algo import value_loss
from roles.training.microbatch import MicroBatch
from transport.wire import TrainBatch, ValueRequest


def clipped_value_loss(
    mb: MicroBatch, batch: TrainBatch, values: torch.Tensor, clip: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped value loss of micro-batch `mb`'s `values` against its returns, and its metrics."""
    f = mb.fields
    loss, m = value_loss(
        values,
        f["old_values"],
        f["returns"],
        f["loss_mask"],
        clip=clip,
        num_tokens=batch.global_num_tokens,
        num_seqs=batch.global_num_seqs,
    )
    m.update(value_loss=float(loss.detach()), tokens=float(f["loss_mask"].sum()))
    return loss, m


def unpad_rows(rows_BT: torch.Tensor, spans: list[tuple[int, int]], first: int, out: torch.Tensor) -> int:
    """Write the right-padded rows of a micro-batch into the flat `out`, row i at
    `spans[first + i]`; returns the index of the row after them (rows past the spans,
    padding of a rank's last micro-batch, are not written)."""
    if first >= len(spans):
        return first
    for i in range(rows_BT.shape[0]):
        start, end = spans[first + i]
        out[start:end] = rows_BT[i, : end - start]
    return first + rows_BT.shape[0]


def sequence_spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence of `cu` (cumulative lengths)."""
    c = cu.tolist()
    return [(c[i], c[i + 1]) for i in range(len(c) - 1)]


def as_batch(req: ValueRequest) -> TrainBatch:
    """`req`'s sequences as a `TrainBatch` (zero masks and advantages), for micro-batching."""
    n = req.input_ids.numel()
    zeros = torch.zeros(n, dtype=torch.float32)
    return TrainBatch(
        step=-1,
        input_ids=req.input_ids,
        cu_seqlens=req.cu_seqlens,
        loss_mask=zeros,
        behaviour_logprobs=zeros,
        advantages=zeros,
        global_num_tokens=0,
        global_num_seqs=0,
    )
