"""RL maths without surprises: REINFORCE++ over gapped multi-turn masks, in
roles/algo and through the controller's batching, the one advantage entry point, and the
behaviour/proximal KL metric."""

from __future__ import annotations

import itertools
import math
import typing

import pytest
import torch

from roles.algo import gae_advantages, reinforce_pp_advantages
from roles.algo.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGES, compute_advantages
from roles.algo.losses import behaviour_proximal_kl, ppo_policy_loss
from roles.controller.batching import build_train_batches
from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from runtime.config import AlgorithmConfig
from transport.wire import FinishReason, TrainBatch

GAMMA = 0.5
# Row 0: turn 1 (2 tokens) | observation (2 tokens, mask 0) | turn 2 (2 tokens), reward 1.
# Row 1: one turn of 3 tokens, then padding, reward 2.
MASK_BT = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
# Returns by hand: row 0 from the end 1, 0.5, (observation: passes), 0.25, 0.125; row 1: 2, 1, 0.5.
RETURNS = [[0.125, 0.25, 0.0, 0.0, 0.5, 1.0], [0.5, 1.0, 2.0, 0.0, 0.0, 0.0]]
SAMPLED = [0.125, 0.25, 0.5, 1.0, 0.5, 1.0, 2.0]  # the 7 sampled tokens' returns: the whitening set


def _white(x: float) -> float:
    mean = sum(SAMPLED) / len(SAMPLED)
    var = sum((v - mean) ** 2 for v in SAMPLED) / len(SAMPLED)  # population variance
    return (x - mean) / math.sqrt(var + 1e-8)


EXPECTED_ADV = [[_white(r) if m else 0.0 for r, m in zip(row, mrow, strict=True)] for row, mrow in
                zip(RETURNS, MASK_BT.tolist(), strict=True)]  # fmt: skip


def _old_reinforce_pp(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """The code before gapped masks were handled: the return reset to 0 at every mask-0 token."""
    valid_BT = mask_BT != 0
    running = torch.zeros(rewards_BT.shape[0])
    cols = []
    for t in reversed(range(rewards_BT.shape[1])):
        running = torch.where(valid_BT[:, t], rewards_BT[:, t] + gamma * running, torch.zeros_like(running))
        cols.append(running)
    returns = torch.stack(cols[::-1], dim=1)
    valid = returns[valid_BT]
    white = (returns - valid.mean()) / torch.sqrt(valid.var(unbiased=False) + 1e-8)
    return torch.where(valid_BT, white, torch.zeros_like(white))


def test_reinforce_pp_carries_the_return_across_an_observation() -> None:
    rewards = torch.zeros(2, 6)
    rewards[0, 5], rewards[1, 2] = 1.0, 2.0
    rewards[0, 2] = 7.0  # a reward on an observation token is ignored
    adv, ret = reinforce_pp_advantages(rewards, MASK_BT, gamma=GAMMA)
    torch.testing.assert_close(ret, torch.tensor(RETURNS))
    torch.testing.assert_close(adv, torch.tensor(EXPECTED_ADV))
    # Observation tokens are out of the whitening: the sampled advantages have mean 0, std ~1.
    sampled = adv[MASK_BT != 0]
    assert float(sampled.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(sampled.var(unbiased=False)) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_pp_on_single_turn_rows_is_unchanged(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 3, (7,), generator=gen)
    lengths = torch.randint(1, 6, (7,), generator=gen)
    positions = torch.arange(9)[None]
    mask = ((positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])).float()  # one span a row
    rewards = torch.randn(7, 9, generator=gen) * mask
    adv, _ = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    torch.testing.assert_close(adv, _old_reinforce_pp(rewards, mask, 0.9))


def _sample(index: int, n: int, reward: float, loss_mask: list[int] | None = None) -> SampleRec:
    return SampleRec(
        index=index,
        token_ids=torch.arange(10, 10 + n),
        logprobs=torch.full((n,), -0.3),
        versions=torch.zeros(n, dtype=torch.int32),
        finish_reason=FinishReason.STOP,
        reward=reward,
        loss_mask=None if loss_mask is None else torch.tensor(loss_mask, dtype=torch.uint8),
    )


def _group(gid: int, samples: list[SampleRec]) -> Group:
    group = Group(gid=gid, prompt=Prompt(uid=gid, row=gid, prompt_ids=[1, 2], text=""), n=len(samples),
                  request_id=f"r{gid}", admitted_version=0)  # fmt: skip
    for s in samples:
        group.samples[s.index] = s
    return group


def _segments(batch: TrainBatch) -> list[list[float]]:
    cu = batch.cu_seqlens.tolist()
    return [batch.advantages[a:b].tolist() for a, b in itertools.pairwise(cu)]


def test_batching_reinforce_pp_uses_the_loss_mask_and_carries_across_the_observation() -> None:
    groups = [_group(0, [_sample(0, 6, 1.0, [1, 1, 0, 0, 1, 1]), _sample(1, 3, 2.0)])]
    (batch,), _ = build_train_batches(groups, step=0, advantage="reinforce_pp", norm_by_std=True, num_shards=1,
                                      gamma=GAMMA)  # fmt: skip
    got = _segments(batch)
    assert got[0] == pytest.approx([0.0, 0.0, *EXPECTED_ADV[0]], abs=1e-6)
    assert got[1] == pytest.approx([0.0, 0.0, *EXPECTED_ADV[1][:3]], abs=1e-6)


def test_batching_reinforce_pp_puts_the_reward_on_the_last_sampled_token() -> None:
    # The budget cut the sample after an observation: its reward belongs to token 1.
    groups = [_group(0, [_sample(0, 4, 1.0, [1, 1, 0, 0]), _sample(1, 2, 3.0)])]
    (batch,), _ = build_train_batches(groups, step=0, advantage="reinforce_pp", norm_by_std=True, num_shards=1,
                                      gamma=GAMMA)  # fmt: skip
    sampled = [0.5, 1.0, 1.5, 3.0]
    mean = sum(sampled) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in sampled) / 4 + 1e-8)
    w = [(v - mean) / std for v in sampled]
    assert _segments(batch) == [pytest.approx([0, 0, w[0], w[1], 0, 0], abs=1e-6),
                                pytest.approx([0, 0, w[2], w[3]], abs=1e-6)]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_batching_reinforce_pp_on_single_turn_samples_is_unchanged(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (6,), generator=gen).tolist()
    rewards = torch.randn(6, generator=gen).tolist()
    groups = [_group(g, [_sample(i, lengths[2 * g + i], rewards[2 * g + i]) for i in range(2)]) for g in range(3)]
    (batch,), _ = build_train_batches(groups, step=0, advantage="reinforce_pp", norm_by_std=True, num_shards=1,
                                      gamma=0.9)  # fmt: skip
    # The old batching: a row's mask over its whole length, its reward on its last token.
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    token_rewards = torch.zeros(6, width)
    token_rewards[torch.arange(6), torch.tensor(lengths) - 1] = torch.tensor(rewards)
    old = _old_reinforce_pp(token_rewards, mask, 0.9)
    for got, row, n in zip(_segments(batch), old, lengths, strict=True):
        assert got == pytest.approx([0.0, 0.0, *row[:n].tolist()], abs=1e-6)


def test_the_entry_point_accepts_every_algorithm_advantage() -> None:
    assert set(ADVANTAGES) == set(typing.get_args(typing.get_type_hints(AlgorithmConfig)["advantage"]))
    rewards, gids = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 5, 5])
    mask = torch.tensor([[1.0, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    values = torch.tensor([[0.5, 0.1, 9.0, 0.2], [0.3, 9, 9, 9], [0.1, 0.2, 0.3, 0.4], [9, 0.6, 0.7, 9]])
    token_rewards = torch.zeros(4, 4)
    token_rewards[0, 3], token_rewards[1, 0], token_rewards[2, 3], token_rewards[3, 2] = 1.0, 0.0, 3.0, 1.0
    for name in ADVANTAGES:
        out = compute_advantages(name, rewards, gids, mask_BT=mask, values_BT=values, gamma=0.9, lam=0.8)
        if name in ADVANTAGE_ESTIMATORS:
            per_sample = compute_advantages(name, rewards, gids)
            torch.testing.assert_close(out, per_sample[:, None] * mask)
        elif name == "reinforce_pp":
            torch.testing.assert_close(out, reinforce_pp_advantages(token_rewards, mask, gamma=0.9)[0])
        else:
            torch.testing.assert_close(out, gae_advantages(token_rewards, values, mask, gamma=0.9, lam=0.8)[0])
    # Hand values of two: GRPO (unbiased std) and GAE on row 1 (one token: A = r - V).
    grpo = compute_advantages("grpo", rewards, gids, mask_BT=mask)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(grpo[0], torch.tensor([s, s, 0.0, s]), atol=1e-5, rtol=0)
    gae = compute_advantages("gae", rewards, gids, mask_BT=mask, values_BT=values, gamma=0.9, lam=0.8)
    assert gae[1].tolist() == pytest.approx([-0.3, 0.0, 0.0, 0.0])


def test_the_entry_point_spreads_a_sample_advantage_over_its_span() -> None:
    mask, span = torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0]])
    out = compute_advantages("dr_grpo", torch.tensor([2.0, 0.0]), torch.tensor([0, 0]),
                             mask_BT=torch.cat([mask, mask]), span_BT=torch.cat([span, span]))  # fmt: skip
    assert out.tolist() == [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]


def test_the_entry_point_names_every_valid_estimator_and_what_is_missing() -> None:
    with pytest.raises(ValueError, match="valid: grpo, dr_grpo, rloo, reinforce_pp_baseline, reinforce_pp, gae"):
        compute_advantages("ppo", torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="per token: pass mask_BT"):
        compute_advantages("reinforce_pp", torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs values_BT"):
        compute_advantages("gae", torch.zeros(1), torch.zeros(1, dtype=torch.int64), mask_BT=torch.ones(1, 2))


def test_behaviour_proximal_kl_is_unbiased_for_kl_behaviour_to_proximal() -> None:
    # behav = (1/2, 1/4, 1/4), prox = (1/4, 1/4, 1/2) over three tokens; four draws in the
    # behaviour policy's proportions make the sample mean the exact expectation under it.
    behav_p, prox_p = [0.5, 0.5, 0.25, 0.25], [0.25, 0.25, 0.25, 0.5]
    behav = torch.tensor([[math.log(p) for p in behav_p]])
    prox = torch.tensor([[math.log(p) for p in prox_p]])
    kl_behav_prox = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # = ln(2) / 4
    assert behaviour_proximal_kl(prox, behav, torch.ones(1, 4)) == pytest.approx(kl_behav_prox, abs=1e-6)
    # The old metric, k3 of KL(prox || behav) over these behaviour draws, reads (1.5 - ln 2) / 4.
    _, metrics = ppo_policy_loss(prox.clone().requires_grad_(), prox, behav, torch.ones(1, 4), torch.ones(1, 4),
                                 clip_low=0.2, clip_high=0.2, importance_cap=10.0)  # fmt: skip
    assert metrics["kl_behaviour_proximal"] == pytest.approx(kl_behav_prox, abs=1e-6)
    assert behaviour_proximal_kl(prox, behav, torch.zeros(1, 4)) == 0.0
