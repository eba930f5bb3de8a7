"""Distillation in the controller: training batches carry the teacher's per-token advantage
(replace / add, single- and multi-turn), a sample the teacher failed gets none, and a
teacher's garbage answer is refused sample by sample."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from roles.controller.batching import Distill, build_train_batches
from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.controller.teaching import check_score
from transport.wire import FinishReason, TeacherScore, TrainBatch


def _sample(index: int, behav: list[float], teacher: list[float] | None, reward: float, mask=None) -> SampleRec:
    return SampleRec(
        index=index,
        token_ids=torch.arange(10, 10 + len(behav), dtype=torch.int64),
        logprobs=torch.tensor(behav),
        versions=torch.zeros(len(behav), dtype=torch.int32),
        finish_reason=FinishReason.STOP,
        reward=reward,
        teacher_logprobs=None if teacher is None else torch.tensor(teacher),
        loss_mask=None if mask is None else torch.tensor(mask, dtype=torch.uint8),
    )


def _group(samples: list[SampleRec]) -> Group:
    prompt = Prompt(uid=0, row=0, prompt_ids=[1, 2], text="")
    g = Group(gid=0, prompt=prompt, n=len(samples), request_id="r0", admitted_version=0)
    g.samples = {s.index: s for s in samples}
    return g


def _responses(batch: TrainBatch, values: torch.Tensor) -> list[list[float]]:
    """Each sequence's response part (after its 2 prompt tokens)."""
    return [values[a + 2 : b].tolist() for a, b in itertools.pairwise(batch.cu_seqlens.tolist())]


def _build(groups: list[Group], distill: Distill | None) -> TrainBatch:
    (batch,), _ = build_train_batches(
        groups, step=0, advantage="grpo", norm_by_std=False, num_shards=1, distill=distill
    )
    return batch


def test_replace_gives_minus_the_reverse_kl_per_token() -> None:
    g = _group([_sample(0, [-1.0, -2.0], [-1.5, -1.0], 1.0), _sample(1, [-0.5], [-0.25], 0.0)])
    batch = _build([g], Distill(coef=2.0, mode="replace"))
    assert _responses(batch, batch.advantages) == [pytest.approx([-1.0, 2.0]), pytest.approx([0.5])]
    assert _responses(batch, batch.behaviour_logprobs) == [pytest.approx([-1.0, -2.0]), pytest.approx([-0.5])]


def test_add_puts_it_on_top_of_the_task_advantage() -> None:
    # dr_grpo-style (no std): rewards 1 and 0, group mean 0.5: task advantages +0.5 and -0.5
    g = _group([_sample(0, [-1.0, -2.0], [-1.5, -1.0], 1.0), _sample(1, [-0.5], [-0.25], 0.0)])
    assert _responses(_build([g], None), _build([g], None).advantages) == [
        pytest.approx([0.5, 0.5]),
        pytest.approx([-0.5]),
    ]
    batch = _build([g], Distill(coef=1.0, mode="add"))
    assert _responses(batch, batch.advantages) == [pytest.approx([0.0, 1.5]), pytest.approx([-0.25])]


def test_multi_turn_environment_tokens_get_no_distillation() -> None:
    # tokens 1-2 came from the environment: mask 0 there, the teacher's values ignored
    s = _sample(0, [-1.0, 0.0, 0.0, -2.0], [-1.5, -9.0, -9.0, -1.0], 1.0, mask=[1, 0, 0, 1])
    other = _sample(1, [-1.0], [-1.0], 1.0)
    batch = _build([_group([s, other])], Distill(coef=1.0, mode="replace"))
    assert _responses(batch, batch.advantages)[0] == pytest.approx([-0.5, 0.0, 0.0, 1.0])
    assert _responses(batch, batch.loss_mask)[0] == [1.0, 0.0, 0.0, 1.0]
    assert batch.global_num_tokens == 3


def test_a_sample_without_teacher_logprobs_gets_no_distillation_term() -> None:
    g = _group([_sample(0, [-1.0, -2.0], None, 1.0), _sample(1, [-0.5], [-0.25], 0.0)])
    batch = _build([g], Distill(coef=1.0, mode="replace"))
    assert _responses(batch, batch.advantages) == [pytest.approx([0.0, 0.0]), pytest.approx([0.25])]


@pytest.mark.parametrize(
    ("score", "why"),
    [
        (None, "no answer"),
        (TeacherScore(0, error="boom", reason="refused"), "boom"),
        (TeacherScore(0, [-1.0]), "1 log-probabilities for 2 tokens"),
        (TeacherScore(0, [-1.0, math.nan]), "not a finite number"),
        (TeacherScore(0, [-1.0, 3.0]), "not a finite number <= 0"),
        (TeacherScore(0, [-1.0, -math.inf]), "not a finite number"),
    ],
)
def test_garbage_answers_are_refused(score: TeacherScore | None, why: str) -> None:
    assert why in check_score(score, 2)


def test_a_good_answer_passes() -> None:
    assert check_score(TeacherScore(0, [-1.0, 0.0]), 2) == ""
