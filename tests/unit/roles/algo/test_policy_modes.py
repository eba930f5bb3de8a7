"""Policy-loss modes, aggregations and rollout correction: hand-computed values, and verl's
`core_algos` formulas written out as an independent reference (functions named `_verl_*`).

Conventions that differ from verl (docs/algorithms.md, "Algorithms"): our `vanilla` has no dual clip
(verl's `vanilla` always applies `clip_ratio_c`, our `dual-clip` is verl's `vanilla`);
seq-mean modes divide by the sequences that have a response token (verl: every row of the
micro-batch) or by the step's global count; `seq-mean-token-sum-norm` divides by
sequences × a constant (Dr. GRPO), verl only by the padded width.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from roles.algo import aggregate, ppo_policy_loss
from roles.algo.rollout_correction import ISCorrection, importance_weights

CLIP = {"clip_low": 0.2, "clip_high": 0.2, "importance_cap": 10.0}
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the last row is fully masked


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum()


# --- aggregation ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean", (2 + 4) / 2),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / (2 * 4)),
        ("token-sum", 10.0),
    ],
)
def test_aggregations_by_hand_ignore_the_fully_masked_row(mode: str, expected: float) -> None:
    assert float(aggregate(PER_TOKEN, MASK, mode, norm_tokens=4.0)) == pytest.approx(expected)


def test_seq_mean_token_sum_norm_defaults_to_the_row_width() -> None:
    assert float(aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm")) == pytest.approx(10 / (2 * 3))


def test_unknown_aggregation_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"seq-mean-token-sum-norm.*token-sum"):
        aggregate(PER_TOKEN, MASK, "mean")


def _verl_agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """verl `core_algos.agg_loss` (single micro-batch form)."""
    if loss_agg_mode == "token-mean":
        return _masked_mean(loss_mat, loss_mask)
    seq_sum = torch.sum(loss_mat * loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.mean(seq_sum)
    if loss_agg_mode == "seq-mean-token-mean":
        return torch.mean(seq_sum / torch.sum(loss_mask, dim=-1))
    assert loss_agg_mode == "seq-mean-token-sum-norm"
    return torch.sum(seq_sum) / loss_mask.shape[-1]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregations_agree_with_verl(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) < 0.7).float()
    mask[:, 0] = 1.0  # verl divides by every row: give each one a token
    ours = float(aggregate(x, mask, mode, norm_tokens=7.0))
    verl = float(_verl_agg_loss(x, mask, mode))
    # verl's seq-mean-token-sum-norm is not divided by the number of sequences (5 here).
    assert ours == pytest.approx(verl / 5 if mode == "seq-mean-token-sum-norm" else verl, abs=1e-6)


# --- loss modes by hand ------------------------------------------------------------
def _one_token(ratio: float, adv: float, **kwargs: object) -> tuple[float, float, dict[str, float]]:
    """(loss, d loss / d logp, metrics) for one token with prox = behav = 0."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    zeros = torch.zeros(1, 1)
    loss, m = ppo_policy_loss(logp, zeros, zeros, torch.tensor([[adv]]), torch.ones(1, 1), **{**CLIP, **kwargs})
    loss.backward()
    return loss.item(), float(logp.grad), m


def test_dual_clip_bounds_negative_advantages_only() -> None:
    loss, grad, m = _one_token(5.0, -1.0, mode="dual-clip", clip_ratio_c=3.0)
    assert (loss, grad, m["dual_clip_fraction"]) == (pytest.approx(3.0), 0.0, 1.0)
    loss, grad, m = _one_token(5.0, -1.0, mode="vanilla")  # no dual clip: -r A = 5, gradient -A r = 5
    assert (loss, grad) == (pytest.approx(5.0), pytest.approx(5.0)) and "dual_clip_fraction" not in m
    loss, grad, m = _one_token(2.0, -1.0, mode="dual-clip", clip_ratio_c=3.0)  # below c: vanilla
    assert (loss, grad, m["dual_clip_fraction"]) == (pytest.approx(2.0), pytest.approx(2.0), 0.0)
    loss, grad, _ = _one_token(5.0, 1.0, mode="dual-clip", clip_ratio_c=3.0)  # A > 0: the upper clip
    assert (loss, grad) == (pytest.approx(-1.2), 0.0)


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    loss, grad, m = _one_token(1.5, 1.0, mode="cispo")
    # -sg(clip(1.5)) * A * logp = -1.2 * ln 1.5; gradient -1.2 (vanilla PPO would give 0)
    assert (loss, grad) == (pytest.approx(-1.2 * math.log(1.5)), pytest.approx(-1.2))
    assert m["clip_fraction"] == 1.0
    loss, grad, m = _one_token(0.5, -1.0, mode="cispo")
    assert (loss, grad) == (pytest.approx(0.8 * math.log(0.5)), pytest.approx(0.8))
    _, grad, m = _one_token(1.1, 1.0, mode="cispo")
    assert grad == pytest.approx(-1.1) and m["clip_fraction"] == 0.0


def test_gspo_uses_the_sequence_geometric_mean_ratio() -> None:
    # Row 0: token log-ratios ln 2 and 0 -> s = sqrt(2) on both; row 1: fully masked.
    logp = torch.tensor([[math.log(2.0), 0.0], [0.5, 0.5]], requires_grad=True)
    zeros = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])
    loss, m = ppo_policy_loss(logp, zeros, zeros, adv, mask, mode="gspo", agg="seq-mean-token-mean", **CLIP)
    loss.backward()
    s = math.sqrt(2.0)
    assert loss.item() == pytest.approx(s)  # A < 0 and s > 1.2: the unclipped -s A
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[s / 2, s / 2], [0.0, 0.0]]))
    assert m["ratio_max"] == pytest.approx(s) and m["clip_fraction"] == 0.0
    adv_pos = -adv
    loss, m = ppo_policy_loss(logp, zeros, zeros, adv_pos, mask, mode="gspo", agg="seq-mean-token-mean", **CLIP)
    assert loss.item() == pytest.approx(-1.2) and m["clip_fraction"] == 1.0


@pytest.mark.parametrize("mode", ["vanilla", "dual-clip", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"])
def test_micro_batches_sum_to_the_full_loss_in_every_mode(mode: str, agg: str) -> None:
    gen = torch.Generator().manual_seed(7)
    logp, prox, behav, adv = (torch.randn(4, 6, generator=gen) * 0.3 for _ in range(4))
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]).float()
    kw = dict(mode=mode, agg=agg, norm_tokens=6.0, **CLIP)
    full, _ = ppo_policy_loss(logp, prox, behav, adv, mask, **kw)
    norm = {"num_tokens": float(mask.sum()), "num_seqs": 3.0}
    halves = [
        ppo_policy_loss(logp[s], prox[s], behav[s], adv[s], mask[s], **kw, **norm)[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert sum(halves).item() == pytest.approx(full.item(), abs=1e-6)


def test_empty_mask_gives_zero_in_every_mode() -> None:
    logp = torch.randn(2, 3, requires_grad=True)
    zeros = torch.zeros(2, 3)
    for mode in ("vanilla", "dual-clip", "gspo", "cispo"):
        loss, m = ppo_policy_loss(logp, zeros, zeros, torch.ones(2, 3), zeros, mode=mode, **CLIP)
        assert loss.item() == 0.0 and loss.requires_grad and set(m.values()) == {0.0}


# --- loss modes against verl -----------------------------------------------------------
def _verl_compute_policy_loss_vanilla(old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, c: float) -> tuple:
    """verl `core_algos.compute_policy_loss_vanilla` (token-mean): it always dual-clips."""
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)
    clip1 = torch.maximum(pg1, pg2)
    clipfrac = _masked_mean(torch.gt(pg2, pg1).float(), mask)
    pg3 = -adv * c
    clip2 = torch.min(pg3, clip1)
    clipfrac_lower = _masked_mean(torch.gt(clip1, pg3) * (adv < 0).float(), mask)
    losses = torch.where(adv < 0, clip2, clip1)
    return _masked_mean(losses, mask), clipfrac, clipfrac_lower


def _verl_compute_policy_loss_gspo(old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor) -> tuple:
    """verl `core_algos.compute_policy_loss_gspo` (it forces seq-mean-token-mean)."""
    neg_kl = logp - old
    seq_neg_kl = torch.sum(neg_kl * mask, dim=-1) / torch.sum(mask, dim=-1).clamp(min=1)
    log_ratio = torch.clamp(logp - logp.detach() + seq_neg_kl.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)
    loss = _verl_agg_loss(torch.maximum(pg1, pg2), mask, "seq-mean-token-mean")
    return loss, _masked_mean(torch.gt(pg2, pg1).float(), mask)


def _verl_compute_policy_loss_cispo(old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """verl `core_algos.compute_policy_loss_cispo` (token-mean)."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    clipped = torch.clamp(ratio, 0.8, 1.2).detach()
    return _masked_mean(-clipped * adv * logp, mask)


def _random_case(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 9, generator=gen) * 3
    logp = old + torch.randn(6, 9, generator=gen) * 0.6
    adv = torch.randn(6, 9, generator=gen).sign() * torch.rand(6, 1, generator=gen)
    mask = (torch.rand(6, 9, generator=gen) < 0.8).float()
    mask[:, 0] = 1.0
    return old, logp, adv, mask


def _ours(mode: str, old: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, agg: str) -> tuple[Tensor, dict, Tensor]:
    x = logp.clone().requires_grad_()
    loss, m = ppo_policy_loss(x, old, old, adv, mask, mode=mode, agg=agg, clip_ratio_c=3.0, **CLIP)
    loss.backward()
    assert x.grad is not None
    return loss, m, x.grad


def _grad(loss_fn: object, logp: Tensor) -> Tensor:
    x = logp.clone().requires_grad_()
    out = loss_fn(x)  # type: ignore[operator]
    (out[0] if isinstance(out, tuple) else out).backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dual_clip_is_verl_vanilla(seed: int) -> None:
    old, logp, adv, mask = _random_case(seed)
    loss, m, grad = _ours("dual-clip", old, logp, adv, mask, "token-mean")
    ref, clipfrac, lower = _verl_compute_policy_loss_vanilla(old, logp, adv, mask, 3.0)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(float(clipfrac)) and m["dual_clip_fraction"] == pytest.approx(
        float(lower)
    )
    torch.testing.assert_close(grad, _grad(lambda x: _verl_compute_policy_loss_vanilla(old, x, adv, mask, 3.0), logp))
    # Our vanilla is verl's without the dual clip (c -> infinity).
    vanilla, _, _ = _ours("vanilla", old, logp, adv, mask, "token-mean")
    no_dual, _, _ = _verl_compute_policy_loss_vanilla(old, logp, adv, mask, 1e9)
    assert vanilla.item() == pytest.approx(no_dual.item(), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_agrees_with_verl(seed: int) -> None:
    old, logp, adv, mask = _random_case(seed)
    loss, m, grad = _ours("gspo", old, logp, adv, mask, "seq-mean-token-mean")
    ref, clipfrac = _verl_compute_policy_loss_gspo(old, logp, adv, mask)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(float(clipfrac))
    torch.testing.assert_close(grad, _grad(lambda x: _verl_compute_policy_loss_gspo(old, x, adv, mask), logp))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_agrees_with_verl(seed: int) -> None:
    old, logp, adv, mask = _random_case(seed)
    loss, _, grad = _ours("cispo", old, logp, adv, mask, "token-mean")
    assert loss.item() == pytest.approx(_verl_compute_policy_loss_cispo(old, logp, adv, mask).item(), abs=1e-6)
    torch.testing.assert_close(grad, _grad(lambda x: _verl_compute_policy_loss_cispo(old, x, adv, mask), logp))


# --- rollout correction ------------------------------------------------------------
PROX = torch.zeros(2, 3)
BEHAV = -torch.tensor([[math.log(5.0), 0.0, math.log(0.3)], [math.log(2.0), math.log(2.0), 0.0]])  # w = 5,1,.3 / 2,2,-
ROWS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_level_mask_zeroes_weights_outside_the_band() -> None:
    w, m = importance_weights(PROX, BEHAV, ROWS_MASK, ISCorrection(mode="mask", low=0.5, high=2.0))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0], [2.0, 2.0, 0.0]]))
    assert m["masked_fraction"] == pytest.approx(2 / 5) and m["truncated_fraction"] == 0.0
    abs_diff = (math.log(5.0) + 0 + abs(math.log(0.3)) + 2 * math.log(2.0)) / 5
    assert m["behaviour_proximal_abs_diff"] == pytest.approx(abs_diff)
    assert m["importance_weight_max"] == pytest.approx(5.0)


def test_sequence_level_weights_are_the_product_of_token_ratios() -> None:
    # Row 0: 5 * 1 * 0.3 = 1.5; row 1: 2 * 2 = 4 (its unmasked third token does not count).
    w, m = importance_weights(PROX, BEHAV, ROWS_MASK, ISCorrection(level="sequence", cap=3.0))
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [3.0, 3.0, 0.0]]))
    assert m["truncated_fraction"] == pytest.approx(2 / 5)
    w, m = importance_weights(PROX, BEHAV, ROWS_MASK, ISCorrection(mode="mask", level="sequence", low=0.5, high=2.0))
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]))
    assert m["masked_fraction"] == pytest.approx(2 / 5)


def test_masked_tokens_leave_the_gradient() -> None:
    logp = PROX.clone().requires_grad_()
    adv = torch.ones(2, 3)
    c = ISCorrection(mode="mask", low=0.5, high=2.0)
    loss, m = ppo_policy_loss(logp, PROX, BEHAV, adv, ROWS_MASK, correction=c, agg="token-sum", **CLIP)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -torch.tensor([[0.0, 1.0, 0.0], [2.0, 2.0, 0.0]]))
    assert m["masked_fraction"] == pytest.approx(2 / 5)
