"""The reward model's parts without processes: how scores combine into a sample's reward,
the judge's parser and template, the scorer's bound on reward_model requests, the config
checks and placement, and the classifier on a real tiny Qwen2 sequence classifier (its
text, batching, truncation and timeout)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from roles.controller.scoring import Bound, Weights, combine
from roles.reward.classifier import RewardClassifier, sample_text
from roles.reward.judge import fill, parse_score
from runtime.config import RewardModelConfig
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.launch.placement import plan_processes
from runtime.preflight.environment import check_launch
from runtime.tiny.model import build_tokenizer, make_tiny_model
from transport import wire

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]


def score(value: float, error: str = "") -> wire.RewardScore:
    return wire.RewardScore(sample_id=0, reward=value, error=error)


def item(completion: str = "xy", prompt: str = "<policy template>abc", **kw: object) -> wire.RewardItem:
    return wire.RewardItem(sample_id=0, prompt=prompt, completion=completion, **kw)  # type: ignore[arg-type]


# --- combining ---------------------------------------------------------------------------
def test_a_reward_is_the_weighted_rule_and_model_scores_plus_the_environments() -> None:
    w = Weights(functions=0.5, model=2.0)
    assert combine(score(1.0), score(-0.25), 0.125, w) == (0.5 * 1.0 + 2.0 * -0.25 + 0.125, "")
    assert combine(score(1.0), None, None, w) == (0.5, "")  # no reward_model placed
    assert combine(None, score(3.0), None, w) == (6.0, "")  # no reward role placed
    assert combine(None, None, 0.75, w) == (0.75, "")


def test_a_failed_part_counts_zero_and_its_error_is_the_samples() -> None:
    w = Weights(functions=1.0, model=1.0)
    assert combine(score(1.0), score(0.0, "reward model timed out after 1s"), None, w) == (
        1.0,
        "reward model timed out after 1s",
    )
    assert combine(score(0.0, "f raised"), score(0.0, "judge"), None, w) == (0.0, "f raised")  # the first error


def test_reward_model_requests_are_bounded_per_request_and_rule_requests_per_call() -> None:
    model, rule = Bound(10.0, per_request=1), Bound(1.0, concurrency=4, per_sample=2)
    assert (model.calls(8), model.calls(1)) == (1, 1)
    assert rule.calls(8) == 16


# --- the judge's parser and template ----------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7", 7.0),
        (" Score: 8/10", 8.0),
        ("I think it deserves a rating of 3.5 overall, not 9", 3.5),
        ("grade=-2", -2.0),
        ("It is 10 out of 10", 10.0),
        ("Yes, the answer is right.", 1.0),
        ("no. Not correct", 0.0),
        ("YES", 1.0),
        ("score .5", 0.5),
    ],
)
def test_the_built_in_parser_reads_a_number_else_yes_or_no(text: str, value: float) -> None:
    assert parse_score(text) == value


@pytest.mark.parametrize("text", ["", "unsure", "nobody knows", "yesterday", "v2.x"])
def test_the_built_in_parser_refuses_text_without_a_score(text: str) -> None:
    with pytest.raises(ValueError, match="no number or yes/no"):
        parse_score(text)


def test_the_template_gets_the_users_prompt_the_response_and_the_answer() -> None:
    template = "Q={prompt} R={response} A={answer} {{literal}}"
    assert fill(template, item(messages=MESSAGES, answer=42)) == "Q=abc R=xy A=42 {literal}"
    assert fill(template, item()) == "Q=<policy template>abc R=xy A= {literal}"  # no messages: the prompt text


# --- config and placement ---------------------------------------------------------------
def _check(*overrides: str) -> None:
    check_launch(load_config(None, list(overrides)))


def test_reward_model_config_errors_name_their_key(tmp_path: Path) -> None:
    placed = "placement=[{role: controller}, {role: rollout}, {role: trainer}, {role: reward_model}]"
    with pytest.raises(ConfigError, match=r"neither reward\.model\.path nor reward\.judge\.model"):
        _check(placed)
    with pytest.raises(ConfigError, match=r"reward\.model\.path '/nope' is not a directory"):
        _check("reward.model.path=/nope")
    with pytest.raises(ConfigError, match="both set"):
        _check("reward.model.path=tiny", f"reward.judge.model={tmp_path}")
    with pytest.raises(ConfigError, match=r"reward.judge.template: KeyError 'question'"):
        _check(f"reward.judge.model={tmp_path}", "reward.judge.template='{question} {response}'")
    with pytest.raises(ConfigError, match=r"reward\.judge\.parser 'nowhere:f': cannot import"):
        _check(f"reward.judge.model={tmp_path}", "reward.judge.parser=nowhere:f")
    with pytest.raises(ConfigError, match=r"reward.judge.max_tokens \(600\) must be below"):
        _check(f"reward.judge.model={tmp_path}", "reward.judge.max_tokens=600")
    _check("reward.model.path=tiny")
    _check(f"reward.judge.model={tmp_path}")


def test_a_judge_on_a_gpu_counts_its_engine_in_the_gpus_memory(tmp_path: Path) -> None:
    placement = ("placement=[{role: controller}, {role: rollout, devices: [0]}, {role: trainer}, "
                 "{role: reward_model, devices: [0]}]")  # fmt: skip
    judge = [f"reward.judge.model={tmp_path}", "trainer.device=cpu", placement]
    with pytest.raises(ConfigError, match=r"GPU 0 of node 0 is over-committed: .*\(reward_model\) 0\.5 = 1\.10"):
        _check(*judge, "rollout.engine.gpu_memory_utilization=0.6")
    _check(*judge, "rollout.engine.gpu_memory_utilization=0.4")


def test_a_configured_reward_model_gets_a_role_unless_placement_names_one() -> None:
    cfg = load_config(None, ["reward.model.path=tiny"])
    assert [s.name for s in plan_processes(cfg) if s.role == "reward_model"] == ["reward_model-0"]
    cfg = load_config(None, ["reward.model.path=tiny", "placement=[{role: controller}, {role: rollout}, "
                             "{role: trainer}, {role: reward_model, count: 2, devices: [3]}]"])  # fmt: skip
    specs = [s for s in plan_processes(cfg) if s.role == "reward_model"]
    assert [(s.name, s.env["CUDA_VISIBLE_DEVICES"]) for s in specs] == [(f"reward_model-{i}", "3") for i in (0, 1)]
    assert not [s for s in plan_processes(load_config(None, [])) if s.role == "reward_model"]


# --- the classifier on a real tiny model ------------------------------------------------
@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rm") / "classifier", classifier=True, seed=1)


def _classifier(path: Path, **kw: object) -> RewardClassifier:
    c = RewardClassifier(str(path), RewardModelConfig(dtype="float32", **kw), "cpu")  # type: ignore[arg-type]
    c.load()
    return c


def test_the_text_is_the_chat_template_over_the_raw_messages_else_prompt_and_response() -> None:
    tok = build_tokenizer()
    text, templated = sample_text(tok, item(messages=MESSAGES))
    assert templated and text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\nxy<|im_end|>\n"
    )
    tok.chat_template = None
    assert sample_text(tok, item(messages=MESSAGES)) == ("<policy template>abcxy", False)


def test_the_classifier_scores_each_sample_alike_in_any_batch(classifier_dir: Path) -> None:
    c = _classifier(classifier_dir, batch_size=3, max_length=64)
    items = [item("x" * i, messages=MESSAGES) for i in range(1, 6)]
    batched = asyncio.run(c.score(items))
    alone = [c.forward([it])[0] for it in items]
    assert [e for _, e in batched] == [""] * 5
    assert [v for v, _ in batched] == pytest.approx(alone, abs=1e-5)
    assert len({round(v, 6) for v, _ in batched}) == 5  # a real model: different texts, different scores


def test_a_long_sample_keeps_its_end(classifier_dir: Path) -> None:
    c = _classifier(classifier_dir, max_length=16)
    c.tokenizer.chat_template = None  # the text is prompt + response (byte tokens)
    tail = "a response of more than 16 bytes"
    a, b = item(tail, prompt="p" * 500), item(tail, prompt="q" * 500)  # the same last 16 tokens
    assert c.forward([a]) == pytest.approx(c.forward([b]), abs=1e-6)
    assert c.forward([a]) != pytest.approx(c.forward([item(tail[-15:], prompt="q")]), abs=1e-6)


def test_a_request_over_its_bound_fails_its_samples_and_the_next_one_is_scored(classifier_dir: Path) -> None:
    c = _classifier(classifier_dir, batch_size=1, timeout_s=1e-4)
    items = [item("x" * 200, messages=MESSAGES) for _ in range(8)]

    async def two_requests() -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
        first = await c.score(items)
        c.cfg = RewardModelConfig(dtype="float32", timeout_s=60)
        return first, await c.score(items[:1])

    first, second = asyncio.run(two_requests())
    assert first == [(0.0, "reward model timed out after 0.0001s")] * 8
    assert second[0][1] == "" and second[0][0] != 0.0
