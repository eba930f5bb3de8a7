"""Multi-turn keys are checked before anything starts: one line naming the key."""

from __future__ import annotations

import pytest

from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch
from runtime.user_functions import env_factory_takes_context, load_env_factory
from tests.conftest import ROOT

HERE = __name__


def no_args() -> object:
    return object()


def with_context(context: object) -> object:
    return context


def two_args(a: object, b: object) -> object:
    return a, b


def check(*overrides: str) -> None:
    check_launch(load_config(None, list(overrides)))


def test_a_valid_multiturn_config_passes() -> None:
    check("rollout.env=roles.rollout.tool_env:factory", "rollout.tools=[roles.rollout.tools:calculator]")
    check(f"rollout.env={HERE}:no_args", "rollout.max_turns=3", "rollout.max_tokens=16")
    # GAE carries across observation tokens (roles/algo/gae.py), so PPO with a critic is allowed.
    critic = "placement=[{role: controller}, {role: rollout}, {role: trainer}, {role: critic}]"
    check(f"rollout.env={HERE}:no_args", "algorithm.advantage=gae", "rollout.n=1", critic)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["rollout.env=no_such_env_mod:make"], r"rollout\.env 'no_such_env_mod:make': cannot import"),
        (["rollout.env=roles.rollout.tool_env"], r"rollout\.env 'roles\.rollout\.tool_env' must be module:function"),
        ([f"rollout.env={HERE}:two_args"], r"rollout\.env '.*two_args': the factory must take no argument or one"),
        (["rollout.tools=[roles.rollout.tools:nope]"], r"rollout\.tools entry 'roles\.rollout\.tools:nope': 'nope'"),
        (
            [f"rollout.env={HERE}:no_args", "rollout.max_turns=40", "rollout.max_tokens=16"],
            r"rollout\.max_total_tokens \(640 = max_turns \* max_tokens\) must be below rollout\.engine\.max_model_len",
        ),
        (
            [
                f"rollout.env={HERE}:no_args",
                "rollout.tools=[roles.rollout.tools:calculator]",
                "rollout.env_timeout_s=5",
            ],
            r"rollout\.env_timeout_s \(5\) must exceed rollout\.tool_timeout_s \(10\)",
        ),
        ([f"rollout.env={HERE}:no_args", "reward.overlong.enabled=true"], r"rollout\.env: reward\.overlong is not"),
    ],
)
def test_bad_multiturn_keys_fail_naming_the_key(overrides: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=error) as err:
        check(*overrides)
    assert "\n" not in str(err.value)


def test_factories_take_no_argument_or_the_context() -> None:
    assert not env_factory_takes_context(load_env_factory(f"{HERE}:no_args"))
    assert env_factory_takes_context(load_env_factory(f"{HERE}:with_context"))


def test_gsm8k_tool_recipe_is_a_checked_multiturn_config() -> None:
    path = ROOT / "configs" / "gsm8k_tool.yaml"
    cfg = load_config(path, ["model.path=/models/Qwen2.5-1.5B-Instruct"])
    check_launch(cfg)
    assert cfg.rollout.env == "roles.rollout.tool_env:factory"
    assert cfg.rollout.tools == ["roles.rollout.tools:calculator"]
    assert cfg.reward.functions == ["roles.reward.builtin:gsm8k_exact_match"]  # from its base, grpo_gsm8k
    assert '"name": "calculator"' in cfg.data.system_prompt  # the model is told the call format
    assert cfg.data.max_prompt_tokens + cfg.rollout.max_total_tokens < cfg.rollout.engine.max_model_len
    with pytest.raises(ConfigError, match=r"rollout\.max_total_tokens \(1280\) must be below"):
        check_launch(load_config(path, ["rollout.engine.max_model_len=1024"]))
