"""KL estimators: exact expectations on small categoricals, a Monte Carlo check, and controllers."""

from __future__ import annotations

import math

import pytest
import torch

from roles.algo import AdaptiveKLController, FixedKLController, kl_penalty

P = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64)
Q = torch.tensor([0.3, 0.1, 0.2, 0.05, 0.35], dtype=torch.float64)


def _closed_form_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    dist = torch.distributions
    return float(dist.kl_divergence(dist.Categorical(probs=p), dist.Categorical(probs=q)))


def _expectation(estimator: str, p: torch.Tensor, q: torch.Tensor) -> float:
    """E_{x~p}[estimator(x)] summed exactly over the support."""
    return float((p * kl_penalty(p.log(), q.log(), estimator)).sum())


def test_closed_form_matches_hand_computed_two_outcome_case() -> None:
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.25, 0.75], dtype=torch.float64)
    # 0.5*ln(2) + 0.5*ln(2/3) = 0.5*(0.6931472 - 0.4054651)
    assert _closed_form_kl(p, q) == pytest.approx(0.1438410, abs=1e-7)
    assert _expectation("k1", p, q) == pytest.approx(0.1438410, abs=1e-7)
    assert _expectation("k3", p, q) == pytest.approx(0.1438410, abs=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_expect_exact_kl(estimator: str) -> None:
    assert _expectation(estimator, P, Q) == pytest.approx(_closed_form_kl(P, Q), abs=1e-6)
    assert _expectation(estimator, Q, P) == pytest.approx(_closed_form_kl(Q, P), abs=1e-6)


def test_k2_expectation_is_half_mean_square_log_ratio() -> None:
    expected = 0.5 * float((P * (P.log() - Q.log()) ** 2).sum())
    assert _expectation("k2", P, Q) == pytest.approx(expected, abs=1e-12)


def test_k2_close_to_kl_when_distributions_are_close() -> None:
    q_near = P * torch.tensor([1.02, 0.98, 1.01, 0.99, 1.0], dtype=torch.float64)
    q_near = q_near / q_near.sum()
    kl = _closed_form_kl(P, q_near)
    assert _expectation("k2", P, q_near) == pytest.approx(kl, rel=0.05)


def test_k3_is_never_negative() -> None:
    log_ratio = torch.linspace(-50.0, 50.0, 10001, dtype=torch.float64)
    assert bool((kl_penalty(log_ratio, torch.zeros_like(log_ratio), "k3") >= 0).all())
    tiny = torch.tensor([1e-9, -1e-9, 1e-4, -1e-4, 0.0])
    assert bool((kl_penalty(tiny, torch.zeros_like(tiny), "k3") >= 0).all())


def test_k3_clamps_extreme_log_ratios() -> None:
    """A far token's k3 is at most 10, as verl's `kl_penalty` ("low_var_kl") clamps it."""
    out = kl_penalty(torch.tensor([-1e4, 1e4, -5.0, 3.0]), torch.zeros(4), "k3")
    assert bool(torch.isfinite(out).all())
    # exp(5) - 1 - 5 = 142.4 unclamped; exp(-3) - 1 + 3 = 2.0498 stays.
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, 10.0, math.exp(-3.0) - 1 + 3.0]))


def _verl_kl_penalty_low_var_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """verl `core_algos.kl_penalty(..., "low_var_kl")`, written out as the independent reference."""
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def test_low_var_kl_is_k3_and_agrees_with_verl() -> None:
    gen = torch.Generator().manual_seed(3)
    logp, ref = torch.randn(4, 50, generator=gen) * 3, torch.randn(4, 50, generator=gen) * 3
    ours = kl_penalty(logp, ref, "low_var_kl")
    torch.testing.assert_close(ours, kl_penalty(logp, ref, "k3"))
    torch.testing.assert_close(ours, _verl_kl_penalty_low_var_kl(logp, ref), atol=1e-5, rtol=1e-5)
    assert float(ours.max()) == 10.0


def test_monte_carlo_estimates_are_close_to_kl() -> None:
    gen = torch.Generator().manual_seed(1234)
    samples = torch.multinomial(P, 200_000, replacement=True, generator=gen)
    logp, ref_logp = P.log()[samples], Q.log()[samples]
    kl = _closed_form_kl(P, Q)
    for estimator in ("k1", "k3"):
        assert float(kl_penalty(logp, ref_logp, estimator).mean()) == pytest.approx(kl, abs=0.01)


def test_unknown_estimator_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"k1.*k2.*k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_fixed_controller_never_changes() -> None:
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=10.0, n_steps=100)
    assert ctl.value == 0.05


def test_adaptive_controller_hand_computed_steps() -> None:
    ctl = AdaptiveKLController(init_coef=0.1, target=1.0, horizon=100)
    ctl.update(current_kl=2.0, n_steps=10)  # error clipped to +0.2 -> x1.02
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=0.5, n_steps=10)  # error clipped to -0.2 -> x0.98
    assert ctl.value == pytest.approx(0.102 * 0.98)
    ctl.update(current_kl=1.1, n_steps=10)  # error 0.1 -> x1.01
    assert ctl.value == pytest.approx(0.102 * 0.98 * 1.01)


def test_adaptive_controller_direction() -> None:
    rising = AdaptiveKLController(init_coef=0.2, target=0.1, horizon=1000)
    falling = AdaptiveKLController(init_coef=0.2, target=0.1, horizon=1000)
    for _ in range(5):
        rising.update(current_kl=0.15, n_steps=64)
        falling.update(current_kl=0.05, n_steps=64)
    assert rising.value > 0.2 > falling.value
