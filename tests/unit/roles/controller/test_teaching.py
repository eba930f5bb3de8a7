"""The controller's teacher client (roles/controller/teaching.py) and its place in scoring:
a teacher that answers sets each sample's log-probabilities; one that hangs, fails or answers
garbage leaves the samples without them and with a reward error of reason `teacher`, which
the step's failure check counts as it does a reward model's; the step's metrics."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.controller.scoring import Scorer
from roles.controller.teaching import TeacherMeter, Teaching
from transport import wire
from transport.rpc import RemoteError, RequestTimeout


class Server:
    """Answers a TeacherRequest with `answer(items)`, or raises `error`; other kinds: no role."""

    def __init__(self, answer: Any = None, error: Exception | None = None) -> None:
        self.answer, self.error, self.asked = answer, error, 0

    async def request(self, msg: wire.Message, *, peer: bytes, timeout: float) -> wire.Message:
        assert isinstance(msg, wire.TeacherRequest) and timeout > 0
        self.asked += 1
        if self.error is not None:
            raise self.error
        return wire.TeacherResult(scores=self.answer(msg.items))


class Teacher:
    def of(self, kind: str) -> list[Any]:
        return [SimpleNamespace(identity=b"t0", name="teacher-0")] if kind == "teacher" else []


def _group(lengths: list[int]) -> Group:
    g = Group(
        gid=3,
        prompt=Prompt(uid=0, row=0, prompt_ids=[1, 2], text=""),
        n=len(lengths),
        request_id="r",
        admitted_version=0,
    )
    for i, n in enumerate(lengths):
        g.samples[i] = SampleRec(
            index=i,
            token_ids=torch.arange(n),
            logprobs=torch.full((n,), -2.0),
            versions=torch.zeros(n, dtype=torch.int32),
            finish_reason=wire.FinishReason.STOP,
        )
    return g


def _good(items: list[wire.TeacherItem]) -> list[wire.TeacherScore]:
    return [wire.TeacherScore(it.sample_id, [-0.5] * len(it.completion_ids)) for it in items]


def _score(server: Server, group: Group) -> Teaching:
    teaching = Teaching(server, Teacher(), timeout_s=1.0)  # type: ignore[arg-type]
    asyncio.run(teaching.score(group))
    return teaching


def test_answers_land_on_the_samples_and_in_the_metrics() -> None:
    group = _group([3, 2])
    teaching = _score(Server(_good), group)
    assert [s.teacher_logprobs.tolist() for s in group.ordered()] == [[-0.5] * 3, [-0.5] * 2]  # type: ignore[union-attr]
    assert teaching.tokens == 5
    group.last_arrival = teaching.done_at[3] - 0.25
    m = TeacherMeter(teaching).metrics([group])
    assert m["distill_kl"] == pytest.approx(-1.5)  # behaviour -2.0, teacher -0.5
    assert m["teacher_failures"] == 0.0 and m["teacher_wait_s"] == pytest.approx(0.25)
    assert m["teacher_tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("server", "why"),
    [
        (Server(error=RequestTimeout("no reply in 32s")), "teacher-0 request failed: no reply in 32s"),
        (Server(error=RemoteError(wire.ErrorCode.INTERNAL, "boom")), "teacher-0 request failed"),
        (Server(lambda items: [wire.TeacherScore(it.sample_id, [-0.5]) for it in items]), "1 log-probabilities for"),
        (Server(lambda items: [wire.TeacherScore(it.sample_id, [math.nan] * 3) for it in items]), "not a finite"),
        (Server(lambda items: []), "no answer for the sample"),
    ],
)
def test_hung_failed_or_garbage_teachers_leave_an_error(server: Server, why: str) -> None:
    group = _group([3, 3])
    teaching = _score(server, group)
    for s in group.ordered():
        assert s.teacher_logprobs is None and why in s.teacher_error
    assert TeacherMeter(teaching).metrics([group])["teacher_failures"] == 2.0


def test_scoring_asks_the_teacher_beside_the_rewards_and_counts_its_failure() -> None:
    server = Server(error=RequestTimeout("no reply"))
    teaching = Teaching(server, Teacher(), timeout_s=1.0)  # type: ignore[arg-type]
    done: list[Group] = []
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "")
    scorer = Scorer(server, Teacher(), tokenizer, timeout_s=1.0, done=done.append, teacher=teaching.score)  # type: ignore[arg-type]
    group = _group([2, 2])
    asyncio.run(scorer._score(group, None))
    assert done == [group] and server.asked == 1
    assert all(
        s.reward == 0.0 and s.reward_reason == "teacher" and "teacher-0" in s.reward_error for s in group.ordered()
    )
    validation = _group([2])
    asyncio.run(scorer._score(validation, lambda g: None))  # a validation group: no teacher
    assert server.asked == 1
