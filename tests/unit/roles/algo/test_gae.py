"""GAE against hand-computed numbers and a per-row pure-python reference; masked whitening."""

from __future__ import annotations

import math
import random

import pytest
import torch

from roles.algo import gae_advantages, whiten


def test_gae_hand_computed_full_mask() -> None:
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.6, 0.8]])
    mask = torch.ones(1, 4)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # deltas: d3 = 1 - 0.8 = 0.2; d2 = 0.9*0.8 - 0.6 = 0.12; d1 = 0.9*0.6 - 0.4 = 0.14;
    # d0 = 0.9*0.4 - 0.5 = -0.14. gamma*lam = 0.72:
    # A3 = 0.2; A2 = 0.12 + 0.72*0.2 = 0.264; A1 = 0.14 + 0.72*0.264 = 0.33008;
    # A0 = -0.14 + 0.72*0.33008 = 0.0976576.
    torch.testing.assert_close(adv, torch.tensor([[0.0976576, 0.33008, 0.264, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5976576, 0.73008, 0.864, 1.0]]))


def test_gae_hand_computed_inner_mask_ignores_padding() -> None:
    rewards = torch.tensor([[3.0, 0.5, 1.0, 7.0]])
    values = torch.tensor([[9.0, 0.4, 0.6, 9.0]])
    mask = torch.tensor([[False, True, True, False]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # Terminal after position 2: d2 = 1 - 0.6 = 0.4; d1 = 0.5 + 0.9*0.6 - 0.4 = 0.64;
    # A2 = 0.4; A1 = 0.64 + 0.72*0.4 = 0.928.
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.928, 0.4, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.328, 1.0, 0.0]]))


def _reference_gae(
    rewards: list[float], values: list[float], start: int, end: int, gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Textbook GAE over positions [start, end) with V(end) = 0; zeros elsewhere."""
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in range(end - 1, start - 1, -1):
        next_value = values[t + 1] if t + 1 < end else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    ret = [adv[t] + values[t] if start <= t < end else 0.0 for t in range(len(rewards))]
    return adv, ret


@pytest.mark.parametrize("seed", range(6))
def test_gae_matches_reference_loop(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_rows, num_steps = 5, 11
    gamma, lam = rng.uniform(0.5, 1.0), rng.uniform(0.0, 1.0)
    rewards = torch.randn(num_rows, num_steps, generator=gen, dtype=torch.float64)
    values = torch.randn(num_rows, num_steps, generator=gen, dtype=torch.float64)
    mask = torch.zeros(num_rows, num_steps, dtype=torch.float64)
    spans = []
    for row in range(num_rows):
        start = rng.randrange(num_steps)
        end = rng.randint(start, num_steps)  # end == start gives an empty row
        mask[row, start:end] = 1.0
        spans.append((start, end))
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    for row, (start, end) in enumerate(spans):
        ref_adv, ref_ret = _reference_gae(rewards[row].tolist(), values[row].tolist(), start, end, gamma, lam)
        torch.testing.assert_close(adv[row], torch.tensor(ref_adv, dtype=torch.float64))
        torch.testing.assert_close(ret[row], torch.tensor(ref_ret, dtype=torch.float64))


def test_gae_does_not_modify_inputs() -> None:
    rewards, values, mask = torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5)
    before = [t.clone() for t in (rewards, values, mask)]
    gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95)
    assert all(torch.equal(a, b) for a, b in zip(before, (rewards, values, mask), strict=True))


def test_whiten_masked_entries_only() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, population variance 2/3 -> +-sqrt(3/2).
    s = math.sqrt(1.5)
    torch.testing.assert_close(whiten(x, mask, eps=0.0), torch.tensor([[-s, 0.0, s, 0.0]]))
    torch.testing.assert_close(whiten(x, mask, shift_mean=False, eps=0.0), torch.tensor([[2.0 - s, 2.0, 2.0 + s, 0.0]]))


def test_whiten_empty_mask_gives_zeros() -> None:
    out = whiten(torch.randn(2, 3), torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


# --- multi-turn masks: the recursion carries across environment tokens (as verl does) ------


def test_gae_hand_computed_carries_across_a_gap() -> None:
    # Turn 1 = positions 0-1, observation = 2-3 (mask 0), turn 2 = 4-5, padding = 6.
    # Rewards and values at unmasked positions are junk and must not matter.
    rewards = torch.tensor([[0.0, 0.0, 5.0, -5.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.4, 7.0, 7.0, 0.6, 0.8, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # Over the masked tokens alone this is the full-mask case above (values 0.5 0.4 0.6 0.8):
    # d5 = 1 - 0.8 = 0.2; d4 = 0.9*0.8 - 0.6 = 0.12; d1 = 0.9*0.6 - 0.4 = 0.14 (position 1
    # bootstraps from position 4's value across the gap); d0 = 0.9*0.4 - 0.5 = -0.14.
    # A5 = 0.2; A4 = 0.264; A1 = 0.14 + 0.72*0.264 = 0.33008; A0 = -0.14 + 0.72*0.33008.
    torch.testing.assert_close(adv, torch.tensor([[0.0976576, 0.33008, 0.0, 0.0, 0.264, 0.2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5976576, 0.73008, 0.0, 0.0, 0.864, 1.0, 0.0]]))


def _reference_gapped_gae(
    rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Textbook GAE over the masked positions only, taken as one trajectory; zeros elsewhere."""
    kept = [t for t, m in enumerate(mask) if m]
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    last = 0.0
    for i in reversed(range(len(kept))):
        t = kept[i]
        next_value = values[kept[i + 1]] if i + 1 < len(kept) else 0.0
        last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        adv[t], ret[t] = last, last + values[t]
    return adv, ret


@pytest.mark.parametrize("seed", range(6))
def test_gae_with_gaps_matches_gae_over_the_masked_tokens(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    rng = random.Random(seed)
    gamma, lam = rng.uniform(0.5, 1.0), rng.uniform(0.0, 1.0)
    rewards = torch.randn(4, 13, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 13, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 13, generator=gen) < 0.6).double()  # several gaps per row
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    for row in range(4):
        ref_adv, ref_ret = _reference_gapped_gae(
            rewards[row].tolist(), values[row].tolist(), [int(m) for m in mask[row]], gamma, lam
        )
        torch.testing.assert_close(adv[row], torch.tensor(ref_adv, dtype=torch.float64))
        torch.testing.assert_close(ret[row], torch.tensor(ref_ret, dtype=torch.float64))
        # Equivalently: drop the gaps, run GAE on the dense row, scatter back.
        keep = mask[row] != 0
        dense_adv, _ = gae_advantages(
            rewards[row, keep][None], values[row, keep][None], torch.ones(1, int(keep.sum())), gamma=gamma, lam=lam
        )
        torch.testing.assert_close(adv[row, keep], dense_adv[0])
