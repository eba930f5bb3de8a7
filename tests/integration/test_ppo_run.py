"""PPO with a critic end to end on CPU (configs/ppo_hybridflow.yaml): asynchronous
(max_staleness=1), KL to the reference policy folded into token rewards, reward rises
and the critic's explained variance climbs above zero; then the run resumes from its last
checkpoint, critic included, and goes on (which a PPO run once could not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_ppo_hybridflow_learns_with_a_useful_critic(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "configs/ppo_hybridflow.yaml", f"run_dir={run}"]
    out = subprocess.run([*cmd, "checkpoint.every=20"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    m = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 40
    assert all(r["staleness_max"] <= 1 for r in m)
    assert any(r["staleness_max"] == 1 for r in m)
    q = len(m) // 4
    first, last = (sum(r["reward_mean"] for r in rows) / q for rows in (m[:q], m[-q:]))
    assert last > first + 0.05, (first, last)
    ev_last = sum(r["critic_explained_variance"] for r in m[-q:]) / q
    assert ev_last > 0.1, [round(r["critic_explained_variance"], 3) for r in m]
    assert all("critic_value_loss" in r and "kl_reward_penalty" in r for r in m[1:])

    # Resume from step 40's checkpoint (actor, critic, controller) for two more steps.
    out = subprocess.run(
        [*cmd, "checkpoint.every=20", "trainer.total_steps=42", "resume=auto"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "resuming from" in out.stdout and "step-00000040" in out.stdout
    m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == list(range(1, 43))
    critic_log = [json.loads(line) for line in (run / "logs" / "critic-0.jsonl").read_text().splitlines()]
    assert any(e["event"] == "resumed" for e in critic_log)
