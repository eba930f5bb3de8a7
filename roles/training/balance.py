"""Length-balanced binning of sequences into packed micro-batches (as verl's seqlen balancing).

`balanced_bins(lengths, budget, num_bins)` returns bins of sequence indices such that:
every index is in exactly one bin; a bin's total length is at most `budget` unless it
holds a single longer sequence; there are at least `num_bins` bins when there are that
many sequences (ranks pass the largest count of any rank, so every rank runs the same
number of micro-batches); the totals are balanced (longest first, each into the lightest
bin that has room). Each bin lists its indices in increasing order; bins are ordered by
their first index. Pure and deterministic.
"""

from __future__ import annotations

import heapq
import math


def min_bins(lengths: list[int], budget: int) -> int:
    """A lower bound on the bins `balanced_bins` needs: the total over the budget, rounded up."""
    return max(1, math.ceil(sum(min(n, budget) for n in lengths) / budget)) if lengths else 0


def balanced_bins(lengths: list[int], budget: int, num_bins: int | None = None) -> list[list[int]]:
    if not lengths:
        return []
    k = min(len(lengths), max(min_bins(lengths, budget), num_bins or 1))
    while True:
        bins = _fill(lengths, budget, k)
        if bins is not None:
            return sorted((sorted(b) for b in bins), key=lambda b: b[0])
        k += 1


def _fill(lengths: list[int], budget: int, k: int) -> list[list[int]] | None:
    """Longest first into the lightest bin with room; None if some sequence finds none."""
    heap = [(0, b) for b in range(k)]  # (total, bin)
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, b = heap[0]
        if total and total + lengths[i] > budget:
            return None  # the lightest bin is full, so every bin is
        heapq.heapreplace(heap, (total + lengths[i], b))
        bins[b].append(i)
    return bins
