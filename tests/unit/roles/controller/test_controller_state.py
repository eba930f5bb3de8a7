"""The controller's checkpoint state keeps what training needs of an untrained sample,
the loss mask of a multi-turn sample included."""

from __future__ import annotations

import torch

from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.controller.state import ControllerState, LedgerState, decode, encode, group_state, restore_group
from transport.wire import FinishReason


def _group(mask: list[int] | None) -> Group:
    g = Group(gid=3, prompt=Prompt(uid=1, row=2, prompt_ids=[1, 2], text="ab", answer="ab"), n=1, request_id="r",
              admitted_version=4)  # fmt: skip
    g.samples[0] = SampleRec(
        index=0, token_ids=torch.tensor([5, 6, 7]), logprobs=torch.tensor([-0.5, 0.0, -0.25]),
        versions=torch.tensor([4, 4, 5], dtype=torch.int32), finish_reason=FinishReason.STOP, reward=1.5,
        loss_mask=None if mask is None else torch.tensor(mask, dtype=torch.uint8), num_turns=2 if mask else 0,
    )  # fmt: skip
    return g


def _round_trip(g: Group) -> SampleRec:
    ledger = LedgerState(step=1, next_gid=4, gate={}, totals={}, ready=[group_state(g)], pending=[])
    state = decode(encode(ControllerState(ledger=ledger, dataset={})))
    return restore_group(state.ledger.ready[0]).samples[0]


def test_a_multiturn_sample_keeps_its_loss_mask_across_a_checkpoint() -> None:
    s = _round_trip(_group([1, 0, 1]))
    assert s.loss_mask is not None and s.loss_mask.dtype == torch.uint8 and s.loss_mask.tolist() == [1, 0, 1]
    assert (s.token_ids.tolist(), s.versions.tolist(), s.reward, s.num_sampled) == ([5, 6, 7], [4, 4, 5], 1.5, 2)
    assert s.num_turns == 2
    single = _round_trip(_group(None))
    assert single.loss_mask is None and single.num_sampled == 3


def test_batch_stats_count_turns_and_environment_tokens_of_multiturn_samples() -> None:
    from roles.controller.batching import build_train_batches

    multi = _group([1, 0, 1])
    _, stats = build_train_batches([multi], step=0, advantage="reinforce_pp", norm_by_std=False, num_shards=1)
    assert (stats.num_response_tokens, stats.turns_mean, stats.env_tokens_mean) == (2, 2.0, 1.0)
    _, single = build_train_batches([_group(None)], step=0, advantage="reinforce_pp", norm_by_std=False, num_shards=1)
    assert (single.num_response_tokens, single.turns_mean, single.env_tokens_mean) == (3, None, None)


def test_the_teachers_logprobs_survive_a_checkpoint() -> None:
    """A distillation run resumed with scored samples not yet trained trains them on the
    teacher's log-probabilities it had (no second request, no lost distillation term)."""
    g = _group(None)
    g.samples[0].teacher_logprobs = torch.tensor([-1.0, -0.125, -3.0])
    s = _round_trip(g)
    assert s.teacher_logprobs is not None and s.teacher_logprobs.tolist() == [-1.0, -0.125, -3.0]
    assert _round_trip(_group(None)).teacher_logprobs is None
