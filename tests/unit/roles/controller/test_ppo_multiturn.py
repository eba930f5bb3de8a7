"""The controller's PPO pieces on a multi-turn sample (roles/controller/ppo.py): the
reward sits on the last sampled token, the KL penalty only on sampled tokens, GAE carries
across the observation, whitening and the critic metrics see sampled tokens only; a
sample without a mask gives exactly the single-turn result."""

from __future__ import annotations

import torch

from roles.algo import gae_advantages
from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.controller.ppo import mean_kl, sample_gae, token_rewards, value_metrics, whiten_groups
from transport.wire import FinishReason

# turn 1 (3 tokens) | observation (2 tokens, mask 0) | turn 2 (2 tokens)
MASK = [1, 1, 1, 0, 0, 1, 1]
VALUES = [0.1, 0.2, 0.3, 5.0, 5.0, 0.4, 0.5]


def _sample(mask: list[int] | None, values: list[float], reward: float = 1.0) -> SampleRec:
    n = len(values)
    return SampleRec(
        index=0,
        token_ids=torch.arange(n),
        logprobs=torch.full((n,), -0.5) * (1 if mask is None else torch.tensor(mask)),  # 0 on observations
        versions=torch.zeros(n, dtype=torch.int32),
        finish_reason=FinishReason.STOP,
        reward=reward,
        values=torch.tensor(values),
        ref_logprobs=torch.full((n,), -0.7),
        loss_mask=None if mask is None else torch.tensor(mask, dtype=torch.uint8),
    )


def _group(s: SampleRec) -> Group:
    group = Group(gid=0, prompt=Prompt(uid=0, row=0, prompt_ids=[1], text=""), n=1, request_id="r", admitted_version=0)
    group.samples[0] = s
    return group


def test_reward_on_last_sampled_token_and_kl_only_on_sampled_tokens() -> None:
    s = _sample([1, 1, 0, 0], [0.0] * 4)  # the budget cut the sample after an observation
    torch.testing.assert_close(token_rewards(s, 0.0, None), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # k1 estimator: logprob - ref = 0.2 per sampled token, times coef 0.5.
    torch.testing.assert_close(token_rewards(s, 0.5, "k1"), torch.tensor([-0.1, 0.9, 0.0, 0.0]))
    # The batch's mean KL (the adaptive controller's input) is over sampled tokens too: the
    # observation tokens' behaviour logprob is 0, which would read as a KL of 0.7 each.
    assert abs(mean_kl([_group(s)], "k1") - 0.2) < 1e-6


def test_sample_gae_carries_across_the_observation() -> None:
    s = _sample(MASK, VALUES)
    sample_gae(s, gamma=1.0, lam=1.0, kl_coef=0.0, estimator=None)
    assert s.advantages is not None and s.returns is not None
    # gamma = lam = 1: every sampled token's return is the final reward, its advantage 1 - V.
    torch.testing.assert_close(s.returns, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(s.advantages, torch.tensor([0.9, 0.8, 0.7, 0.0, 0.0, 0.6, 0.5]))


def test_sample_gae_equals_the_dense_result_on_sampled_tokens() -> None:
    s = _sample(MASK, VALUES)
    sample_gae(s, gamma=0.9, lam=0.8, kl_coef=0.0, estimator=None)
    keep = torch.tensor(MASK, dtype=torch.bool)
    dense = _sample(None, [v for v, m in zip(VALUES, MASK, strict=True) if m])
    sample_gae(dense, gamma=0.9, lam=0.8, kl_coef=0.0, estimator=None)
    assert s.advantages is not None and dense.advantages is not None
    torch.testing.assert_close(s.advantages[keep], dense.advantages)


def test_single_turn_sample_is_unchanged() -> None:
    s = _sample(None, [0.5, 0.4, 0.6, 0.8])
    sample_gae(s, gamma=0.9, lam=0.8, kl_coef=0.0, estimator=None)
    expected, _ = gae_advantages(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.4, 0.6, 0.8]]), torch.ones(1, 4), gamma=0.9, lam=0.8
    )
    torch.testing.assert_close(s.advantages, expected[0])
    torch.testing.assert_close(s.advantages, torch.tensor([0.0976576, 0.33008, 0.264, 0.2]))


def test_whitening_and_critic_metrics_ignore_observation_tokens() -> None:
    s = _sample(MASK, VALUES)
    sample_gae(s, gamma=1.0, lam=1.0, kl_coef=0.0, estimator=None)
    group = _group(s)
    metrics = value_metrics([group])
    assert abs(metrics["values_mean"] - 0.3) < 1e-6 and abs(metrics["returns_mean"] - 1.0) < 1e-6
    whiten_groups([group])
    assert s.advantages is not None
    keep = torch.tensor(MASK, dtype=torch.bool)
    assert torch.equal(s.advantages[~keep], torch.zeros(2))
    assert abs(float(s.advantages[keep].mean())) < 1e-6
    assert abs(float(s.advantages[keep].std(unbiased=False)) - 1.0) < 1e-3
