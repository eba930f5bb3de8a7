"""Validation metrics (roles/controller/validation.py `summarize`) on groups worked by hand,
and the validation options' checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.controller.validation import summarize
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch


def _group(gid: int, rewards: list[float], lengths: list[int], versions: list[tuple[int, int]]) -> Group:
    g = Group(gid=gid, prompt=Prompt(uid=0, row=0, prompt_ids=[1], text="p"), n=len(rewards), request_id="v",
              admitted_version=0)  # fmt: skip
    for i, (r, length, (lo, hi)) in enumerate(zip(rewards, lengths, versions, strict=True)):
        g.samples[i] = SampleRec(
            index=i, token_ids=torch.zeros(length, dtype=torch.int64), logprobs=torch.zeros(length),
            versions=torch.tensor([lo] + [hi] * (length - 1), dtype=torch.int32), finish_reason="length", reward=r,
        )  # fmt: skip
    return g


def test_pass_and_mean_at_k_by_hand() -> None:
    groups = [
        _group(-1, [1.0, 0.0], [4, 2], [(3, 3), (3, 3)]),  # passes; mean 0.5
        _group(-2, [0.5, 0.25], [3, 3], [(3, 4), (4, 4)]),  # no sample reaches 1.0; mean 0.375
        _group(-3, [0.0], [6], [(2, 2)]),  # a prompt with one sample back (timed-out round)
    ]
    m = summarize(groups, k=2, pass_threshold=1.0)
    assert m["val/prompts"] == 3 and m["val/samples"] == 5
    assert m["val/reward_mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.25 + 0.0) / 5)
    assert m["val/mean@2"] == pytest.approx((0.5 + 0.375 + 0.0) / 3)
    assert m["val/pass@2"] == pytest.approx(1 / 3)
    assert m["val/response_len_mean"] == pytest.approx(18 / 5)
    assert (m["val/policy_version_min"], m["val/policy_version_max"]) == (2, 4)
    assert summarize(groups, k=2, pass_threshold=0.5)["val/pass@2"] == pytest.approx(2 / 3)


def test_an_empty_round_says_so() -> None:
    assert summarize([], k=4, pass_threshold=1.0) == {"val/prompts": 0, "val/samples": 0}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["validation.every=5"], "validation.every needs validation.data"),
        (["validation.every=5", "validation.data=synthetic", "validation.n=300"], "validation.n (300)"),
        (["validation.every=5", "validation.data=synthetic", "validation.max_tokens=4096"], "validation.max_tokens"),
    ],
)
def test_bad_validation_options_are_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_launch(load_config("configs/tiny_cpu.yaml", overrides))


def test_a_missing_validation_file_is_named(tmp_path: Path) -> None:
    from runtime.data.inputs import check_inputs

    cfg = load_config("configs/tiny_cpu.yaml", ["validation.every=5", f"validation.data={tmp_path}/val.jsonl"])
    with pytest.raises(ConfigError, match=re.escape(f"validation.data '{tmp_path}/val.jsonl' does not exist")):
        check_inputs(cfg)
    (tmp_path / "val.jsonl").write_text('{"question": "2+2"}\n')
    with pytest.raises(ConfigError, match=re.escape("val.jsonl:1: no field 'prompt'")):
        check_inputs(cfg)
