"""Training batches: packing layout, hand-computed GRPO advantages, sharding and stats."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from roles.controller.batching import assign_shards, build_train_batches
from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from transport.wire import FinishReason, TrainBatch

EPS = 1e-6  # grpo_advantages' default eps


def _sample(index: int, tokens: list[int], reward: float | None, **extra: torch.Tensor) -> SampleRec:
    return SampleRec(
        index=index,
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        logprobs=torch.tensor([-0.1 * (index + 1) - 0.01 * k for k in range(len(tokens))]),
        versions=torch.zeros(len(tokens), dtype=torch.int32),
        finish_reason=FinishReason.STOP,
        reward=reward,
        **extra,
    )


def _group(gid: int, prompt_ids: list[int], samples: list[SampleRec]) -> Group:
    prompt = Prompt(uid=gid, row=gid, prompt_ids=prompt_ids, text="")
    group = Group(gid=gid, prompt=prompt, n=len(samples), request_id=f"r{gid}", admitted_version=0)
    for s in reversed(samples):  # insertion order must not matter: ordered() sorts by index
        group.samples[s.index] = s
    return group


def _two_groups() -> list[Group]:
    g0 = _group(0, [1, 2, 3], [_sample(0, [10, 11], 1.0), _sample(1, [12], 0.0)])
    g1 = _group(7, [4, 5], [_sample(0, [20, 21, 22], 2.0), _sample(1, [23], 2.0), _sample(2, [24, 25], 5.0)])
    return [g0, g1]


def _segments(batch: TrainBatch, values: torch.Tensor) -> list[list[float]]:
    cu = batch.cu_seqlens.tolist()
    return [values[a:b].tolist() for a, b in itertools.pairwise(cu)]


def test_single_shard_packs_prompt_then_response_in_group_order() -> None:
    (batch,), _ = build_train_batches(
        _two_groups(), step=3, advantage="grpo", norm_by_std=True, num_shards=1, std="population"
    )
    assert batch.step == 3
    assert batch.cu_seqlens.tolist() == [0, 5, 9, 14, 17, 21]
    assert batch.input_ids.dtype == torch.int64
    assert _segments(batch, batch.input_ids) == [
        [1, 2, 3, 10, 11],
        [1, 2, 3, 12],
        [4, 5, 20, 21, 22],
        [4, 5, 23],
        [4, 5, 24, 25],
    ]
    assert _segments(batch, batch.loss_mask) == [
        [0, 0, 0, 1, 1],
        [0, 0, 0, 1],
        [0, 0, 1, 1, 1],
        [0, 0, 1],
        [0, 0, 1, 1],
    ]
    behaviour = _segments(batch, batch.behaviour_logprobs)
    assert behaviour[0] == pytest.approx([0, 0, 0, -0.1, -0.11])
    assert behaviour[1] == pytest.approx([0, 0, 0, -0.2])
    assert behaviour[4] == pytest.approx([0, 0, -0.3, -0.31])
    assert batch.global_num_tokens == 9  # response tokens only
    assert batch.global_num_seqs == 5
    assert batch.returns is None and batch.old_values is None


def test_grpo_advantages_are_group_normalised_and_broadcast_over_response() -> None:
    (batch,), _ = build_train_batches(
        _two_groups(), step=0, advantage="grpo", norm_by_std=True, num_shards=1, std="population"
    )
    # Group 0: rewards (1, 0), mean 0.5, pop std 0.5 → ±0.5 / (0.5 + eps).
    a0 = 0.5 / (0.5 + EPS)
    # Group 7: rewards (2, 2, 5), mean 3, pop std sqrt(2) → (-1, -1, 2) / (sqrt(2) + eps).
    b = 1 / (math.sqrt(2) + EPS)
    expected = [[0, 0, 0, a0, a0], [0, 0, 0, -a0], [0, 0, -b, -b, -b], [0, 0, -b], [0, 0, 2 * b, 2 * b]]
    for got, want in zip(_segments(batch, batch.advantages), expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_grpo_without_std_normalisation_is_reward_minus_group_mean() -> None:
    (batch,), _ = build_train_batches(_two_groups(), step=0, advantage="grpo", norm_by_std=False, num_shards=1)
    expected = [[0, 0, 0, 0.5, 0.5], [0, 0, 0, -0.5], [0, 0, -1, -1, -1], [0, 0, -1], [0, 0, 2, 2]]
    for got, want in zip(_segments(batch, batch.advantages), expected, strict=True):
        assert got == pytest.approx(want)


def test_gae_takes_token_advantages_returns_and_values_from_samples() -> None:
    def gae_sample(index: int, tokens: list[int], adv: list[float], ret: list[float], val: list[float]) -> SampleRec:
        return _sample(
            index, tokens, 1.0, advantages=torch.tensor(adv), returns=torch.tensor(ret), values=torch.tensor(val)
        )

    group = _group(
        0, [1, 2], [gae_sample(0, [5, 6], [0.5, -0.5], [1.0, 0.9], [0.2, 0.3]), gae_sample(1, [7], [2.0], [3.0], [4.0])]
    )
    (batch,), _ = build_train_batches([group], step=0, advantage="gae", norm_by_std=True, num_shards=1)
    assert _segments(batch, batch.advantages) == [[0, 0, 0.5, -0.5], [0, 0, 2.0]]
    assert batch.returns.tolist() == pytest.approx([0, 0, 1.0, 0.9, 0, 0, 3.0])
    assert batch.old_values.tolist() == pytest.approx([0, 0, 0.2, 0.3, 0, 0, 4.0])


def test_gae_without_critic_values_is_an_error() -> None:
    group = _group(0, [1], [_sample(0, [5], 1.0)])
    with pytest.raises(ValueError, match="no advantages"):
        build_train_batches([group], step=0, advantage="gae", norm_by_std=True, num_shards=1)


def test_shards_split_the_step_and_share_global_counts() -> None:
    groups = _two_groups()
    batches, _ = build_train_batches(groups, step=1, advantage="grpo", norm_by_std=True, num_shards=2)
    # Sequence lengths 5, 4, 5, 3, 4; longest first, ties to the lower shard: #0→s0, #2→s1,
    # #1→s0, #4→s1, #3→s0. Loads 12 and 9.
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 5, 9, 12], [0, 5, 9]]
    assert batches[0].input_ids.tolist() == [1, 2, 3, 10, 11, 1, 2, 3, 12, 4, 5, 23]
    assert batches[1].input_ids.tolist() == [4, 5, 20, 21, 22, 4, 5, 24, 25]
    assert {(b.global_num_tokens, b.global_num_seqs, b.step) for b in batches} == {(9, 5, 1)}
    assert sum(int(b.loss_mask.sum()) for b in batches) == 9


def test_more_shards_than_samples_gives_empty_but_valid_batches() -> None:
    group = _group(0, [1, 2], [_sample(0, [5, 6], 1.0), _sample(1, [7], 0.0)])
    batches, stats = build_train_batches([group], step=0, advantage="grpo", norm_by_std=True, num_shards=4)
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 4], [0, 3], [0], [0]]
    for b in batches:
        total = int(b.cu_seqlens[-1])
        for t in (b.input_ids, b.loss_mask, b.behaviour_logprobs, b.advantages):
            assert t.shape == (total,)
        assert (b.input_ids.dtype, b.loss_mask.dtype, b.advantages.dtype) == (torch.int64, torch.float32, torch.float32)
        assert (b.global_num_tokens, b.global_num_seqs) == (3, 2)
    assert stats.num_samples == 2


def test_batch_stats_by_hand() -> None:
    _, stats = build_train_batches(_two_groups(), step=0, advantage="grpo", norm_by_std=True, num_shards=3)
    assert stats.num_samples == 5
    assert stats.num_response_tokens == 9
    assert stats.reward_mean == pytest.approx(2.0)  # (1 + 0 + 2 + 2 + 5) / 5
    assert stats.reward_std == pytest.approx(math.sqrt(14 / 5))  # squared deviations 1, 4, 0, 0, 9
    assert stats.response_len_mean == pytest.approx(9 / 5)


def test_missing_reward_counts_as_zero() -> None:
    group = _group(0, [1], [_sample(0, [5], None), _sample(1, [6], 2.0)])
    (batch,), stats = build_train_batches([group], step=0, advantage="grpo", norm_by_std=False, num_shards=1)
    assert _segments(batch, batch.advantages) == [[0, -1.0], [0, 1.0]]
    assert stats.reward_mean == pytest.approx(1.0)


def test_assign_shards_longest_first_to_lightest() -> None:
    # 5→s0, 4→s1, 3 (index 2)→s1 (4 < 5), 3 (index 3)→s0 (5 < 7), 2→s1 (7 < 8), 1→s0 (8 < 9).
    assert assign_shards([5, 4, 3, 3, 2, 1], 2) == [[0, 3, 5], [1, 2, 4]]
    assert assign_shards([], 3) == [[], [], []]
    assert assign_shards([7], 3) == [[0], [], []]


@given(lengths=st.lists(st.integers(0, 50), max_size=30), num_shards=st.integers(1, 6))
def test_assign_shards_covers_every_index_once_and_balances_tokens(lengths: list[int], num_shards: int) -> None:
    shards = assign_shards(lengths, num_shards)
    assert len(shards) == num_shards
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    assert all(s == sorted(s) for s in shards)
    loads = [sum(lengths[i] for i in s) for s in shards]
    # Greedy longest-first: the heaviest shard exceeds the lightest by at most one sequence.
    assert max(loads) - min(loads) <= max(lengths, default=0)


def test_reinforce_pp_gives_token_level_discounted_whitened_advantages() -> None:
    (batch,), _ = build_train_batches(
        _two_groups(), step=0, advantage="reinforce_pp", norm_by_std=True, num_shards=1, gamma=0.5
    )
    # Returns per response token: (0.5, 1), (0), (0.5, 1, 2), (2), (2.5, 5); whitened over all 9.
    flat = torch.tensor([0.5, 1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.5, 5.0])
    white = ((flat - flat.mean()) / torch.sqrt(flat.var(unbiased=False) + 1e-8)).tolist()
    expected = [[0, 0, 0, *white[0:2]], [0, 0, 0, white[2]], [0, 0, *white[3:6]], [0, 0, white[6]], [0, 0, *white[7:9]]]
    for got, want in zip(_segments(batch, batch.advantages), expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
