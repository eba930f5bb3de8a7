"""Decoupled PPO and value losses, aggregation, entropy and log-probs on hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from roles.algo import (
    aggregate,
    entropy_from_logits,
    explained_variance,
    masked_mean,
    masked_sum,
    ppo_policy_loss,
    token_logprobs,
    value_loss,
)

LN2 = math.log(2.0)
CLIP = {"clip_low": 0.2, "clip_high": 0.2, "importance_cap": 10.0}


def _policy(
    logp: Tensor, prox: Tensor, behav: Tensor, adv: Tensor, mask: Tensor, **kwargs: object
) -> tuple[Tensor, dict[str, float]]:
    return ppo_policy_loss(logp, prox, behav, adv, mask, **{**CLIP, **kwargs})


def _single_token_grad(ratio: float, adv: float, **kwargs) -> tuple[float, float, dict[str, float]]:
    """(loss, d loss / d logp, metrics) for one token with prox = behav = 0."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    zeros = torch.zeros(1, 1)
    loss, metrics = _policy(logp, zeros, zeros, torch.tensor([[adv]]), torch.ones(1, 1), **kwargs)
    loss.backward()
    return loss.item(), float(logp.grad), metrics


def test_masked_sum_and_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert float(masked_sum(x, mask)) == 3.0
    assert float(masked_mean(x, mask)) == 1.5
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(masked_sum(x, mask, dim=0), torch.tensor([1.0, 2.0, 0.0]))


def test_ratio_one_gives_weighted_mean_advantage() -> None:
    prox = torch.tensor([[-1.0, -2.0, -0.5]])
    behav = prox + torch.tensor([[0.0, -LN2, LN2]])  # w = 1, 2, 0.5
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    loss, metrics = _policy(prox.clone().requires_grad_(), prox, behav, adv, torch.ones(1, 3))
    # -(1*1 + 2*(-2) + 0.5*3) / 3 = 0.5
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["importance_weight_max"] == pytest.approx(2.0)
    assert metrics["importance_weight_mean"] == pytest.approx(3.5 / 3)
    assert metrics["ratio_max"] == pytest.approx(1.0)
    assert metrics["truncated_fraction"] == 0.0
    # k3(prox || behav) per token: 0, exp(-ln2) - 1 + ln2, exp(ln2) - 1 - ln2
    expected_kl = ((0.5 - 1 + LN2) + (2 - 1 - LN2)) / 3
    assert metrics["kl_behaviour_proximal"] == pytest.approx(expected_kl, abs=1e-6)


def test_positive_advantage_above_clip_has_no_gradient() -> None:
    loss, grad, metrics = _single_token_grad(ratio=1.5, adv=1.0)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert metrics["clip_fraction"] == 1.0
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_negative_advantage_below_clip_has_no_gradient() -> None:
    loss, grad, metrics = _single_token_grad(ratio=0.5, adv=-1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert metrics["clip_fraction"] == 1.0


def test_positive_advantage_below_clip_is_not_clipped() -> None:
    loss, grad, metrics = _single_token_grad(ratio=0.5, adv=1.0)
    # loss = -ratio*A, d/dlogp = -ratio*A = -0.5
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)
    assert metrics["clip_fraction"] == 0.0


def test_negative_advantage_above_clip_is_not_clipped() -> None:
    loss, grad, metrics = _single_token_grad(ratio=1.5, adv=-1.0)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx(1.5)
    assert metrics["clip_fraction"] == 0.0


def test_asymmetric_clip_bounds() -> None:
    kwargs = {"clip_low": 0.2, "clip_high": 0.28}
    loss, grad, _ = _single_token_grad(ratio=1.25, adv=1.0, **kwargs)
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx(-1.25))
    loss, grad, _ = _single_token_grad(ratio=1.3, adv=1.0, **kwargs)
    assert (loss, grad) == (pytest.approx(-1.28), 0.0)
    loss, grad, _ = _single_token_grad(ratio=0.75, adv=-1.0, **kwargs)
    assert (loss, grad) == (pytest.approx(0.8), 0.0)


def test_importance_weight_truncated_at_cap() -> None:
    prox = torch.tensor([[-1.0, -1.0]])
    behav = prox - torch.tensor([[math.log(5.0), 0.0]])  # w = 5, 1
    logp = prox.clone().requires_grad_()
    adv = torch.tensor([[2.0, 1.0]])
    loss, metrics = _policy(logp, prox, behav, adv, torch.ones(1, 2), importance_cap=3.0)
    loss.backward()
    # -(3*2 + 1*1) / 2 = -3.5; gradient -w*A*ratio/N = (-3, -0.5)
    assert loss.item() == pytest.approx(-3.5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-3.0, -0.5]]))
    assert metrics["truncated_fraction"] == 0.5
    assert metrics["importance_weight_max"] == pytest.approx(5.0)
    assert metrics["importance_weight_mean"] == pytest.approx(3.0)


def test_only_current_logp_receives_gradient() -> None:
    logp = torch.randn(2, 3, requires_grad=True)
    prox = torch.randn(2, 3, requires_grad=True)
    behav = torch.randn(2, 3, requires_grad=True)
    adv = torch.randn(2, 3, requires_grad=True)
    loss, _ = _policy(logp, prox, behav, adv, torch.ones(2, 3))
    loss.backward()
    assert logp.grad is not None
    assert prox.grad is None and behav.grad is None and adv.grad is None


def test_aggregate_token_mean_vs_seq_mean() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token-mean: (1+2+3+4)/4 = 2.5; seq-mean: (mean(1,2,3) + 4)/2 = 3
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx(2.5)
    assert float(aggregate(per_token, mask, "seq-mean")) == pytest.approx(3.0)
    # seq-mean counts only rows with a masked token
    padded = torch.cat([per_token, torch.full((1, 3), 9.0)])
    padded_mask = torch.cat([mask, torch.zeros(1, 3)])
    assert float(aggregate(padded, padded_mask, "seq-mean")) == pytest.approx(3.0)
    with pytest.raises(ValueError, match=r"token-mean.*seq-mean"):
        aggregate(per_token, mask, "sum")


def test_policy_loss_token_mean_vs_seq_mean() -> None:
    adv = -torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])  # ratio 1, w 1 -> per-token loss = -A
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    zeros = torch.zeros(2, 3)
    token_loss, _ = _policy(zeros.clone().requires_grad_(), zeros, zeros, adv, mask)
    seq_loss, _ = _policy(zeros.clone().requires_grad_(), zeros, zeros, adv, mask, agg="seq-mean")
    assert token_loss.item() == pytest.approx(2.5)
    assert seq_loss.item() == pytest.approx(3.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_global_normaliser_makes_micro_batches_sum_to_full_loss(agg: str) -> None:
    gen = torch.Generator().manual_seed(7)
    logp, prox, behav, adv = (torch.randn(4, 6, generator=gen) * 0.3 for _ in range(4))
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]).float()
    full, _ = _policy(logp, prox, behav, adv, mask, agg=agg)
    norm = {"num_tokens": float(mask.sum()), "num_seqs": 3.0}
    halves = [
        _policy(logp[s], prox[s], behav[s], adv[s], mask[s], agg=agg, **norm)[0] for s in (slice(0, 2), slice(2, 4))
    ]
    assert sum(halves).item() == pytest.approx(full.item(), abs=1e-6)


def test_empty_mask_gives_zero_loss_with_graph() -> None:
    logp = torch.randn(2, 3, requires_grad=True)
    zeros = torch.zeros(2, 3)
    for agg in ("token-mean", "seq-mean"):
        loss, metrics = _policy(logp, zeros, zeros, torch.ones(2, 3), zeros, agg=agg)
        loss.backward()
        assert loss.item() == 0.0 and loss.requires_grad
        assert set(metrics.values()) == {0.0}
    assert torch.equal(logp.grad, torch.zeros(2, 3))
    vloss, vmetrics = value_loss(logp, zeros, zeros, zeros, clip=0.2)
    assert vloss.item() == 0.0 and vloss.requires_grad and set(vmetrics.values()) == {0.0}


def test_policy_loss_does_not_modify_inputs() -> None:
    tensors = [torch.randn(2, 4) for _ in range(4)] + [torch.ones(2, 4)]
    before = [t.clone() for t in tensors]
    _policy(*tensors)
    value_loss(*tensors[:4], clip=0.2)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))


def _value_case(v: float, old: float, ret: float, clip: float) -> tuple[float, float, dict[str, float]]:
    values = torch.tensor([[v]], requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1), clip=clip)
    loss.backward()
    return loss.item(), float(values.grad), metrics


def test_value_inside_clip_range_is_unclipped() -> None:
    loss, grad, metrics = _value_case(v=1.1, old=1.0, ret=2.0, clip=0.2)
    assert loss == pytest.approx(0.5 * 0.81)
    assert grad == pytest.approx(-0.9)
    assert metrics == {"value_clip_fraction": 0.0, "value_mean": pytest.approx(1.1)}


def test_value_moved_past_clip_towards_return_uses_clipped_term() -> None:
    # v clipped to 1.2: (1.2 - 2)^2 = 0.64 > (1.9 - 2)^2 = 0.01
    loss, grad, metrics = _value_case(v=1.9, old=1.0, ret=2.0, clip=0.2)
    assert loss == pytest.approx(0.32)
    assert grad == 0.0
    assert metrics["value_clip_fraction"] == 1.0


def test_value_moved_past_clip_away_from_return_stays_unclipped() -> None:
    # v clipped to 0.8: (0.8 - 2)^2 = 1.44 < (0.5 - 2)^2 = 2.25
    loss, grad, metrics = _value_case(v=0.5, old=1.0, ret=2.0, clip=0.2)
    assert loss == pytest.approx(1.125)
    assert grad == pytest.approx(-1.5)
    assert metrics["value_clip_fraction"] == 0.0


def test_value_clip_zero_is_plain_half_mse() -> None:
    loss, grad, metrics = _value_case(v=1.9, old=1.0, ret=2.0, clip=0.0)
    assert loss == pytest.approx(0.005)
    assert grad == pytest.approx(-0.1)
    assert metrics["value_clip_fraction"] == 0.0


def test_explained_variance() -> None:
    ret = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # Var[R] = 2/3, Var[R - V] = Var(0, 0, 1) = 2/9 -> 1 - 1/3
    assert explained_variance(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), ret, mask) == pytest.approx(2 / 3)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 4), ret, mask) == pytest.approx(0.0)
    assert explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask) == 0.0
    assert explained_variance(ret, ret, torch.zeros(1, 4)) == 0.0


def test_entropy_of_uniform_logits_is_log_vocab() -> None:
    logits = torch.full((2, 3, 7), 1000.0)
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(7)))


def test_entropy_is_stable_and_matches_categorical() -> None:
    peaked = entropy_from_logits(torch.tensor([[[1000.0, 0.0, 0.0]]]))
    assert float(peaked) == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)) * 4
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)


def test_token_logprobs_matches_categorical() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 13, generator=gen) * 3
    targets = torch.randint(0, 13, (2, 5), generator=gen)
    expected = torch.distributions.Categorical(logits=logits).log_prob(targets)
    torch.testing.assert_close(token_logprobs(logits, targets), expected)
    out = token_logprobs(logits.to(torch.bfloat16), targets)
    assert out.dtype == torch.float32
