"""Launch checks of environments from the ecosystem (runtime/preflight/ecosystem.py): a missing extra
is named, a verifiers environment Tandem cannot serve is refused in one line, agent
settings that contradict each other name both keys; reasoning-gym rows are seeded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.ecosystem import check_ecosystem
from runtime.preflight.environment import check_launch
from tests.conftest import ROOT

ENVS = str(ROOT / "tests" / "fixtures" / "verifiers_envs")


def _cfg(path: str, *overrides: str) -> Any:
    return load_config(ROOT / path, list(overrides))


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym extra .*pip install -e '\.\[reasoning-gym\]'"):
        check_ecosystem(_cfg("configs/reasoning_gym_tiny_cpu.yaml"))


def test_shipped_recipes_pass_the_launch_checks() -> None:
    check_launch(_cfg("configs/reasoning_gym_tiny_cpu.yaml"))
    check_launch(_cfg("configs/agent_tiny_cpu.yaml"))


def test_verifiers_environment_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(ENVS)
    check_ecosystem(_cfg("tests/fixtures/verifiers_tiny_cpu.yaml"))
    host = _cfg("tests/fixtures/verifiers_tiny_cpu.yaml", "data.verifiers.env={agent: {harness: {id: bash}}}")
    with pytest.raises(ConfigError, match=r"executes model-written code.*runtime\.type=docker"):
        check_ecosystem(host)
    remote = _cfg("tests/fixtures/verifiers_tiny_cpu.yaml", "data.verifiers.env={agent: {runtime: {type: prime}}}")
    with pytest.raises(ConfigError, match=r"prime runtime, which cannot reach"):
        check_ecosystem(remote)
    with pytest.raises(ConfigError, match=r"set data\.render_prompt=false"):
        check_ecosystem(_cfg("tests/fixtures/verifiers_tiny_cpu.yaml", "data.render_prompt=true"))
    with pytest.raises(ConfigError, match=r"data\.verifiers \(environment 'no-such-env'\)"):
        check_ecosystem(_cfg("tests/fixtures/verifiers_tiny_cpu.yaml", "data.verifiers.id=no-such-env"))


def test_agent_settings_that_contradict_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.env and rollout\.agent both drive"):
        check_ecosystem(_cfg("configs/agent_tiny_cpu.yaml", "rollout.env=roles.rollout.synthetic_env:factory"))
    with pytest.raises(ConfigError, match=r"data\.render_prompt=false needs an agent"):
        check_ecosystem(_cfg("configs/tiny_cpu.yaml", "data.render_prompt=false"))


def test_reasoning_gym_rows_are_the_same_for_a_seed(tmp_path: Path) -> None:
    from runtime.data.task_sources import ReasoningGymRows

    cfg = _cfg("configs/reasoning_gym_tiny_cpu.yaml").data
    a, b, c = ReasoningGymRows(cfg, 0), ReasoningGymRows(cfg, 0), ReasoningGymRows(cfg, 1)
    assert [a[i] for i in (5, 0, 999)] == [b[i] for i in (5, 0, 999)]
    assert a[5] != c[5] and len(a) == 1000


def test_reasoning_gym_and_math_rewards() -> None:
    from roles.reward.math_verify import math_equal
    from roles.reward.reasoning_gym import score
    from runtime.data.task_sources import ReasoningGymRows

    row = ReasoningGymRows(_cfg("configs/reasoning_gym_tiny_cpu.yaml").data, 0)[3]
    meta = {"reasoning_gym": row["reasoning_gym"]}
    assert score(completion=f"<answer>{row['answer']}</answer>", answer=row["answer"], metadata=meta) == 1.0
    assert score(completion=str(row["answer"]), answer=row["answer"], metadata=meta) == 0.0  # no <answer> tag
    assert math_equal("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0 and math_equal("x = 3", "#### 4") == 0.0
