"""PPO mini-batches: a rank's shard split into seeded, shuffled subsets of its sequences.

What a caller may rely on:
* In one epoch every sequence of the shard is in exactly one mini-batch, and every rank
  makes exactly `num_mini_batches` of them (some may be empty), so the ranks take the
  same number of optimizer steps.
* Each mini-batch carries the token and sequence counts of that mini-batch summed over
  the ranks of `group` (`global_num_tokens` / `global_num_seqs`), so a loss normalised by
  them is the mean over the whole mini-batch, as `build_train_batches` does for a batch.
* The order depends only on (seed, step, epoch, rank): a rerun shuffles the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from transport.wire import TRAIN_BATCH_TOKEN_FIELDS, TrainBatch


def select_sequences(batch: TrainBatch, seqs: list[int]) -> TrainBatch:
    """The packed batch of sequences `seqs` of `batch`, in that order (counts unchanged)."""
    cu = batch.cu_seqlens.tolist()
    spans = [torch.arange(cu[i], cu[i + 1]) for i in seqs]
    index = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.int64)
    lengths = torch.tensor([len(s) for s in spans], dtype=torch.int64)
    new_cu = torch.zeros(len(seqs) + 1, dtype=batch.cu_seqlens.dtype)
    new_cu[1:] = lengths.cumsum(0)
    fields = {name: _take(getattr(batch, name), index) for name in TRAIN_BATCH_TOKEN_FIELDS}
    return TrainBatch(
        step=batch.step,
        cu_seqlens=new_cu,
        global_num_tokens=batch.global_num_tokens,
        global_num_seqs=batch.global_num_seqs,
        **fields,
    )


def _take(t: torch.Tensor | None, index: torch.Tensor) -> Any:
    return None if t is None else t[index]


def shuffled_splits(num_seqs: int, num_mini_batches: int, generator: torch.Generator) -> list[list[int]]:
    """A random permutation of range(num_seqs) cut into `num_mini_batches` parts whose
    sizes differ by at most one (the first parts are the larger)."""
    order = torch.randperm(num_seqs, generator=generator)
    return [part.tolist() for part in torch.tensor_split(order, num_mini_batches)]


def epoch_mini_batches(
    batch: TrainBatch,
    num_mini_batches: int,
    *,
    seed: int,
    epoch: int,
    rank: int,
    device: torch.device,
    group: Any = None,
) -> list[TrainBatch]:
    """This rank's mini-batches of one epoch, each with its global counts over `group`
    (a collective over `group`: every rank calls it with the same `num_mini_batches`)."""
    g = torch.Generator().manual_seed(_mix(seed, batch.step, epoch, rank))
    parts = shuffled_splits(batch.cu_seqlens.numel() - 1, num_mini_batches, g)
    minis = [select_sequences(batch, p) for p in parts]
    counts = torch.tensor(
        [[float(m.loss_mask.sum()), float(m.cu_seqlens.numel() - 1)] for m in minis],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(counts, group=group)
    for m, (tokens, seqs) in zip(minis, counts.tolist(), strict=True):
        m.global_num_tokens, m.global_num_seqs = int(tokens), int(seqs)
    return minis


def _mix(*parts: int) -> int:
    h = 0
    for p in parts:
        h = (h * 1_000_003 + p) % (2**63 - 1)
    return h
