"""The stale-drop warning (roles/controller/stale_drops.py): one warning per run once the
groups dropped as stale pass 5 % of those seen (and at least 4), carrying the dropped and
trained groups' mean response lengths and the max_staleness that would have kept them all;
below either bound, nothing."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.controller.stale_drops import MIN_GROUPS, StaleDropWatch, response_tokens
from transport.wire import FinishReason


def group(gid: int, lengths: list[int]) -> Group:
    g = Group(gid=gid, prompt=Prompt(uid=gid, row=gid, prompt_ids=[1], text="p", answer="a"), n=len(lengths),
              request_id=f"g{gid}", admitted_version=0)  # fmt: skip
    for i, n in enumerate(lengths):
        g.samples[i] = SampleRec(
            index=i, token_ids=torch.ones(n, dtype=torch.int64), logprobs=torch.zeros(n),
            versions=torch.zeros(n, dtype=torch.int32), finish_reason=FinishReason.LENGTH,
        )  # fmt: skip
    return g


def test_response_tokens_is_the_mean_sample_length() -> None:
    assert response_tokens(group(0, [100, 300])) == 200.0
    assert response_tokens(Group(gid=1, prompt=group(0, [1]).prompt, n=2, request_id="x", admitted_version=0)) == 0


def test_long_groups_dropped_past_five_percent_warn_once_with_the_figures() -> None:
    watch = StaleDropWatch(max_staleness=2)
    watch.trained([group(g, [200, 300]) for g in range(60)])  # 60 trained, mean 250 tokens
    for g, behind in ((100, 3), (101, 5), (102, 4)):
        watch.dropped(group(g, [2048, 2048]), behind)
    with capture_logs() as logs:
        assert not watch.check(7)  # 3 groups: fewer than MIN_GROUPS
        watch.dropped(group(103, [1500, 1700]), 3)
        assert watch.check(8)  # 4 of 64 groups: 6.25 %
        assert not watch.check(9)  # once per run
    (warning,) = [r for r in logs if r["event"] == "stale_drops"]
    assert warning["log_level"] == "warning" and warning["step"] == 8
    assert warning["dropped_groups"] == MIN_GROUPS and warning["dropped_fraction"] == 0.0625
    assert warning["dropped_response_tokens_mean"] == (3 * 2048 + 1600) / 4
    assert warning["trained_response_tokens_mean"] == 250.0
    assert warning["keeps_all_at"] == 5 and warning["max_staleness"] == 2
    assert "rollout.max_staleness=5 would have kept all" in warning["hint"]


def test_a_few_drops_in_a_long_run_say_nothing() -> None:
    watch = StaleDropWatch(max_staleness=1)
    watch.trained([group(g, [10]) for g in range(200)])
    for g in range(10):  # 10 of 210: under 5 %
        watch.dropped(group(1000 + g, [10]), 2)
    with capture_logs() as logs:
        assert not watch.check(30)
    assert not logs and not watch.warned
