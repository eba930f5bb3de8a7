"""Advantages: hand-computed GRPO / Dr. GRPO / RLOO / REINFORCE++(-baseline) values, group
handling (singletons), and verl's `core_algos` estimators written out as references."""

from __future__ import annotations

import math

import pytest
import torch

from roles.algo import (
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

SQRT_3_2 = math.sqrt(1.5)  # |r - mean| / pop-std for rewards (0, 1, 2)


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_grpo_population_std_per_group() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0, 3.0])
    group_ids = torch.tensor([4, 4, 4, 9, 9])
    # Group 4: mean 1, pop std sqrt(2/3). Group 9: mean 4, pop std 1.
    _close(grpo_advantages(rewards, group_ids, std="population"), [-SQRT_3_2, 0.0, SQRT_3_2, 1.0, -1.0])


def test_grpo_default_is_the_unbiased_std() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0, 3.0])
    group_ids = torch.tensor([4, 4, 4, 9, 9])
    # Group 4: unbiased std 1 -> (-1, 0, 1). Group 9: unbiased std sqrt(2) -> ±1/sqrt(2).
    r2 = 1 / math.sqrt(2.0)
    _close(grpo_advantages(rewards, group_ids), [-1.0, 0.0, 1.0, r2, -r2])
    with pytest.raises(ValueError, match="unbiased, population"):
        grpo_advantages(rewards, group_ids, std="sample")


def test_grpo_without_std_is_mean_centred() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0, 3.0])
    group_ids = torch.tensor([4, 4, 4, 9, 9])
    _close(grpo_advantages(rewards, group_ids, norm_by_std=False), [-1.0, 0.0, 1.0, 1.0, -1.0])


def test_grpo_singletons_and_constant_groups_get_zero() -> None:
    rewards = torch.tensor([3.0, 1.0, 1.0, -2.0])
    group_ids = torch.tensor([0, 1, 1, 2])
    _close(grpo_advantages(rewards, group_ids, eps=0.0), [0.0, 0.0, 0.0, 0.0])
    _close(grpo_advantages(rewards, group_ids, norm_by_std=False), [0.0, 0.0, 0.0, 0.0])


def test_grpo_ids_need_not_be_sorted_or_contiguous() -> None:
    rewards = torch.tensor([0.0, 5.0, 1.0, 3.0, 2.0])
    group_ids = torch.tensor([100, -7, 100, -7, 100])
    _close(grpo_advantages(rewards, group_ids, std="population"), [-SQRT_3_2, 1.0, 0.0, -1.0, SQRT_3_2])


def test_grpo_is_permutation_equivariant() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=gen)
    group_ids = torch.randint(0, 5, (24,), generator=gen)
    perm = torch.randperm(24, generator=gen)
    full = grpo_advantages(rewards, group_ids)
    torch.testing.assert_close(grpo_advantages(rewards[perm], group_ids[perm]), full[perm])


def test_rloo_leave_one_out_baseline() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 7.0, 4.0, 1.0])
    group_ids = torch.tensor([2, 2, 2, 5, 8, 8])
    # Group 2: 0-1.5, 1-1, 2-0.5. Group 5 singleton. Group 8: 4-1, 1-4.
    _close(rloo_advantages(rewards, group_ids), [-1.5, 0.0, 1.5, 0.0, 3.0, -3.0])


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 9.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2])
    # Centred: (-0.5, 0.5, -0.5, 0.5), batch mean 0, pop std 0.5; the singleton stays 0
    # and is left out of the statistics.
    _close(reinforce_pp_baseline_advantages(rewards, group_ids), [-1.0, 1.0, -1.0, 1.0, 0.0])


def test_reinforce_pp_discounts_per_token_and_whitens_over_tokens() -> None:
    # Row 0: 3 tokens, reward 1 on the last, gamma 0.5 -> returns (0.25, 0.5, 1). Row 1:
    # 1 token, reward -1 -> return -1; its padding stays 0. Row 2: fully masked.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    flat = torch.tensor([0.25, 0.5, 1.0, -1.0])
    white = (flat - flat.mean()) / torch.sqrt(flat.var(unbiased=False) + 1e-8)
    expected = torch.tensor([[*white[:3].tolist()], [white[3].item(), 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_is_the_group_centred_reward() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0])
    group_ids = torch.tensor([0, 0, 0, 1])
    _close(compute_advantages("dr_grpo", rewards, group_ids), [-1.0, 0.0, 1.0, 0.0])


def test_integer_rewards_are_accepted() -> None:
    adv = grpo_advantages(torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]), std="population")
    assert adv.is_floating_point()
    _close(adv, [-SQRT_3_2, 0.0, SQRT_3_2])


def test_compute_advantages_dispatches() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 4.0])
    group_ids = torch.tensor([0, 0, 0, 1])
    torch.testing.assert_close(compute_advantages("grpo", rewards, group_ids), grpo_advantages(rewards, group_ids))
    torch.testing.assert_close(
        compute_advantages("grpo", rewards, group_ids, norm_by_std=False),
        grpo_advantages(rewards, group_ids, norm_by_std=False),
    )
    torch.testing.assert_close(compute_advantages("rloo", rewards, group_ids), rloo_advantages(rewards, group_ids))
    torch.testing.assert_close(
        compute_advantages("reinforce_pp_baseline", rewards, group_ids),
        reinforce_pp_baseline_advantages(rewards, group_ids),
    )


def test_compute_advantages_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"grpo.*dr_grpo.*rloo.*reinforce_pp_baseline"):
        compute_advantages("ppo", torch.zeros(2), torch.zeros(2, dtype=torch.int64))


def test_inputs_are_not_modified() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0])
    group_ids = torch.tensor([1, 1, 0, 0])
    before = rewards.clone(), group_ids.clone()
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        compute_advantages(name, rewards, group_ids)
    assert torch.equal(rewards, before[0]) and torch.equal(group_ids, before[1])


def test_empty_batch() -> None:
    empty = torch.zeros(0)
    ids = torch.zeros(0, dtype=torch.int64)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert compute_advantages(name, empty, ids).shape == (0,)


def test_broadcast_to_tokens_zero_outside_mask() -> None:
    adv_S = torch.tensor([2.0, -1.0])
    mask_BT = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    expected = torch.tensor([[0.0, 2.0, 2.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    assert torch.equal(broadcast_to_tokens(adv_S, mask_BT), expected)
    assert torch.equal(broadcast_to_tokens(adv_S, mask_BT.float()), expected)


# --- verl core_algos as the reference -------------------------------------------------
def _verl_compute_grpo_outcome_advantage(scores: list[float], index: list[int], norm: bool) -> list[float]:
    """verl `compute_grpo_outcome_advantage` (epsilon 1e-6, torch.std: unbiased)."""
    by_id: dict[int, list[float]] = {}
    for sc, i in zip(scores, index, strict=True):
        by_id.setdefault(i, []).append(sc)
    out = []
    for sc, i in zip(scores, index, strict=True):
        group = torch.tensor(by_id[i])
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(group) == 1 else (group.mean(), group.std())
        out.append(float((sc - mean) / (std + 1e-6)) if norm else float(sc - mean))
    return out


def _verl_compute_rloo_outcome_advantage(scores: list[float], index: list[int]) -> list[float]:
    """verl `compute_rloo_outcome_advantage`."""
    by_id: dict[int, list[float]] = {}
    for sc, i in zip(scores, index, strict=True):
        by_id.setdefault(i, []).append(sc)
    out = []
    for sc, i in zip(scores, index, strict=True):
        n = len(by_id[i])
        mean = sum(by_id[i]) / n
        out.append(sc * n / (n - 1) - mean * n / (n - 1) if n > 1 else sc)
    return out


def _verl_reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """verl `compute_reinforce_plus_plus_outcome_advantage` (masked_whiten: unbiased variance)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    mean = (returns * mask).sum() / mask.sum()
    var = ((returns - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (returns - mean) * torch.rsqrt(var + 1e-8) * mask


def _random_groups(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (24,), generator=gen).float() + torch.rand(24, generator=gen)
    return rewards, torch.arange(24) // 4  # six groups of four


@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_and_dr_grpo_agree_with_verl(seed: int) -> None:
    rewards, ids = _random_groups(seed)
    ref = _verl_compute_grpo_outcome_advantage(rewards.tolist(), ids.tolist(), norm=True)
    _close(compute_advantages("grpo", rewards, ids), ref)
    ref = _verl_compute_grpo_outcome_advantage(rewards.tolist(), ids.tolist(), norm=False)
    _close(compute_advantages("dr_grpo", rewards, ids), ref)


def test_singletons_differ_from_verl_by_the_documented_rule() -> None:
    rewards, ids = torch.tensor([0.0, 1.0, 5.0]), torch.tensor([0, 0, 1])
    assert _verl_compute_grpo_outcome_advantage(rewards.tolist(), ids.tolist(), norm=True)[2] == pytest.approx(5.0)
    assert float(compute_advantages("grpo", rewards, ids)[2]) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_agrees_with_verl(seed: int) -> None:
    rewards, ids = _random_groups(seed)
    _close(rloo_advantages(rewards, ids), _verl_compute_rloo_outcome_advantage(rewards.tolist(), ids.tolist()))


def test_reinforce_pp_agrees_with_verl_up_to_the_variance_convention() -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 9, (6,), generator=gen)
    mask = (torch.arange(8)[None] < lengths[:, None]).float()
    rewards = torch.zeros(6, 8)
    rewards[torch.arange(6), lengths - 1] = torch.randn(6, generator=gen)
    ours, _ = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    n = float(mask.sum())
    # verl's masked_whiten divides by the unbiased std, ours by the population one.
    torch.testing.assert_close(ours, _verl_reinforce_plus_plus(rewards, mask, 0.9) * math.sqrt(n / (n - 1)))
