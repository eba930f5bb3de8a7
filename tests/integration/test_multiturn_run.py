"""End to end on CPU with a multi-turn environment: configs/multiturn_tiny_cpu.yaml (real
vLLM-CPU rollout running two-turn episodes, real 2-rank FSDP2 over gloo, no reward role)
finishes within the staleness bound and learns the synthetic task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_multiturn_tiny_run_learns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "configs/multiturn_tiny_cpu.yaml", f"run_dir={run}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    metrics = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "kind" not in m]
    assert len(metrics) == 40
    assert all(m["staleness_max"] <= 1 for m in metrics)
    # Sampled tokens only: two turns of at most 24 (the feedback between them is not counted).
    assert all(0 < m["response_len_mean"] <= 48 for m in metrics)
    assert all(m["turns_mean"] == 2.0 and m["env_tokens_mean"] > 0 for m in metrics)
    q = len(metrics) // 4
    first = sum(m["reward_mean"] for m in metrics[:q]) / q
    last = sum(m["reward_mean"] for m in metrics[-q:]) / q
    assert last > first + 0.05, (first, last)
