"""The pure parts of packed training: chunked logprobs/entropy (value and gradient equal the
full-logits computation), the length-balanced bins, the packed layout of a micro-batch,
and the trainer benchmark's batch and FLOP arithmetic."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.trainer import case_lengths, make_batch, summary, train_flops
from roles.algo import entropy_from_logits, token_logprobs
from roles.kernels.token_stats import TokenStatsHead, chunked_token_stats
from roles.training.balance import balanced_bins, min_bins
from roles.training.microbatch import pack_micro_batches, split_micro_batches


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("grads", ["both", "logp", "entropy"])
def test_chunked_stats_equal_full_logits_in_value_and_gradient(chunk: int, grads: str) -> None:
    torch.manual_seed(0)
    T, D, V = 37, 16, 300
    h = (torch.randn(T, D) * 3).requires_grad_()
    w = torch.randn(V, D).requires_grad_()
    t = torch.randint(0, V, (T,))
    a, b = torch.randn(T), torch.randn(T)

    def objective(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        return (logp * a).sum() * (grads != "entropy") + (ent * b).sum() * (grads != "logp")

    logp, ent = chunked_token_stats(h, w, t, chunk)
    objective(logp, ent).backward()
    got = (h.grad.clone(), w.grad.clone())  # type: ignore[union-attr]
    h.grad = w.grad = None
    logits = h @ w.t()
    ref_logp, ref_ent = token_logprobs(logits, t), entropy_from_logits(logits)
    objective(ref_logp, ref_ent).backward()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], w.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_chunked_stats_gradient_when_one_output_is_unused(used: str) -> None:
    """Autograd hands the unused output's gradient as None: that branch of the backward."""
    torch.manual_seed(1)
    T, D, V = 29, 8, 200
    h, w = torch.randn(T, D, dtype=torch.float64, requires_grad=True), torch.randn(V, D, requires_grad=True)
    t, a = torch.randint(0, V, (T,)), torch.randn(T, dtype=torch.float64)
    logp, ent = chunked_token_stats(h, w.double(), t, 8)
    ((logp if used == "logp" else ent) * a).sum().backward()
    got = (h.grad.clone(), w.grad.clone())  # type: ignore[union-attr]
    h.grad = w.grad = None
    logits = h @ w.double().t()
    ref = token_logprobs(logits, t) if used == "logp" else entropy_from_logits(logits)
    (ref * a).sum().backward()
    torch.testing.assert_close(got[0], h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], w.grad, atol=1e-5, rtol=1e-4)


def test_head_is_a_plain_linear_layer_outside_targets() -> None:
    w = torch.nn.Parameter(torch.randn(11, 4))
    head = TokenStatsHead(w, chunk=3)
    h = torch.randn(2, 5, 4)
    torch.testing.assert_close(head(h), h @ w.t())
    targets = torch.randint(0, 11, (2, 5))
    with head.targets(targets):
        out = head(h)
    assert out.shape == (2, 5, 2)
    torch.testing.assert_close(out[..., 0], token_logprobs(h @ w.t(), targets))


def test_bins_cover_every_sequence_once_within_budget_and_balanced() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(1, 60))] + [rng.choice([1, 900])]
        budget = rng.choice([256, 512, 1000])
        forced = rng.choice([None, 1, 5, 80])
        bins = balanced_bins(lengths, budget, forced)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(len(b) == 1 or sum(lengths[i] for i in b) <= budget for b in bins)
        assert len(bins) >= min(len(lengths), max(min_bins(lengths, budget), forced or 1))
        assert all(b == sorted(b) for b in bins) and [b[0] for b in bins] == sorted(b[0] for b in bins)


def test_bins_balance_tokens_better_than_in_order_splitting() -> None:
    lengths = [4000, 64, 64, 3000, 128, 2000, 100, 900, 64, 3500, 200, 80]
    bins = balanced_bins(lengths, 5000)
    totals = [sum(lengths[i] for i in b) for b in bins]
    assert len(bins) == min_bins(lengths, 5000) == 3
    assert max(totals) - min(totals) <= 1000


def test_a_packed_micro_batch_gathers_back_to_the_padded_layout() -> None:
    batch = make_batch([9, 3, 5], vocab=50)
    (packed,) = pack_micro_batches(batch, budget=100)
    (padded,) = split_micro_batches(batch, budget=100)
    p = packed.packed
    assert p is not None
    assert p.cu_seqlens.tolist() == [0, 9, 12, 17] and p.max_len == 9
    assert p.position_ids_1P[0].tolist() == [*range(9), *range(3), *range(5)]
    torch.testing.assert_close(p.input_ids_1P[0], batch.input_ids)
    assert packed.spans == padded.spans == ((0, 9), (9, 12), (12, 17))
    # next-token position j of row i is packed position start_i + j, wherever token j + 1 exists
    next_ids = torch.roll(p.input_ids_1P[0], -1)[p.gather_BL]
    valid = padded.attention_mask_BT[:, 1:].bool()
    torch.testing.assert_close(next_ids[valid], padded.input_ids_BT[:, 1:][valid])


def test_bench_cases_and_flops() -> None:
    assert case_lengths("fixed_1k", 65536, 4096) == [1024] * 64
    assert case_lengths("fixed_4k", 65536, 4096) == [4096] * 16
    mix = case_lengths("length_mix", 65536, 4096)
    assert sum(mix) >= 65536 and min(mix) >= 64 and max(mix) <= 4096 and max(mix) / min(mix) > 10
    assert train_flops([10, 20], 100, 8, 2) == 6 * 100 * 30 + 6 * (100 + 400) * 8 * 2
    assert train_flops([10, 20], 100, 8, 2, attention=False) == 6 * 100 * 30
    cases = {
        "fixed_4k": {"engine": {"mfu": 0.5, "mfu_6n": 0.45, "tokens_per_s": 3.0, "peak_gb": 9.0, "first_loss": 0.1},
                     "bare": {"mfu": 0.3, "tokens_per_s": 2.0, "peak_gb": 20.0, "first_loss": 0.1}},
        "length_mix": {"engine": {"mfu": 0.4, "mfu_6n": 0.38, "tokens_per_s": 4.0, "peak_gb": 7.0, "first_loss": 0.2},
                       "bare": {"oom": True}},
    }  # fmt: skip
    assert summary(cases) == {"mfu_4k": 0.5, "mfu_6n_4k": 0.45, "mfu_6n_length_mix": 0.38, "speedup_length_mix": None,
                              "peak_gb": 9.0, "loss_match": True}  # fmt: skip
