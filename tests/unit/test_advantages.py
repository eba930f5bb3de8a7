"""Sequence-level advantages: hand-computed GRPO / RLOO / REINFORCE++ values and group handling."""

from __future__ import annotations

import math

import pytest
import torch

from roles.algo import (
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

SQRT_3_2 = math.sqrt(1.5)  # |r - mean| / pop-std for rewards (0, 1, 2)


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_grpo_uses_population_std_per_group() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0, 3.0])
    group_ids = torch.tensor([4, 4, 4, 9, 9])
    # Group 4: mean 1, pop std sqrt(2/3). Group 9: mean 4, pop std 1.
    _close(grpo_advantages(rewards, group_ids), [-SQRT_3_2, 0.0, SQRT_3_2, 1.0, -1.0])


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
    _close(grpo_advantages(rewards, group_ids), [-SQRT_3_2, 1.0, 0.0, -1.0, SQRT_3_2])


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


def test_reinforce_pp_whitens_over_batch() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # mean 2.5, pop std sqrt(1.25)
    s = math.sqrt(1.25)
    _close(reinforce_pp_advantages(rewards), [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])


def test_reinforce_pp_baseline_subtracts_group_mean_first() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    # Centred: (-0.5, 0.5, -0.5, 0.5): batch mean 0, pop std 0.5.
    _close(reinforce_pp_advantages(rewards, group_ids), [-1.0, 1.0, -1.0, 1.0])


def test_integer_rewards_are_accepted() -> None:
    adv = grpo_advantages(torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]))
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
    torch.testing.assert_close(compute_advantages("reinforce_pp", rewards, None), reinforce_pp_advantages(rewards))


def test_compute_advantages_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"grpo.*rloo.*reinforce_pp"):
        compute_advantages("ppo", torch.zeros(2), torch.zeros(2, dtype=torch.int64))


def test_inputs_are_not_modified() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0])
    group_ids = torch.tensor([1, 1, 0, 0])
    before = rewards.clone(), group_ids.clone()
    for name in ("grpo", "rloo", "reinforce_pp"):
        compute_advantages(name, rewards, group_ids)
    assert torch.equal(rewards, before[0]) and torch.equal(group_ids, before[1])


def test_empty_batch() -> None:
    empty = torch.zeros(0)
    ids = torch.zeros(0, dtype=torch.int64)
    for name in ("grpo", "rloo", "reinforce_pp"):
        assert compute_advantages(name, empty, ids).shape == (0,)


def test_broadcast_to_tokens_zero_outside_mask() -> None:
    adv_S = torch.tensor([2.0, -1.0])
    mask_BT = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    expected = torch.tensor([[0.0, 2.0, 2.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    assert torch.equal(broadcast_to_tokens(adv_S, mask_BT), expected)
    assert torch.equal(broadcast_to_tokens(adv_S, mask_BT.float()), expected)
