"""End to end on CPU with `weight_sync.backend=nccl` (a gloo group on CPU): the tiny run
finishes, every version reaches the rollout over the group formed once, and the
staleness bound holds. About 70-90 s on 2 cores (most of it is start-up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_tiny_run_with_the_collective_backend(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", f"run_dir={run_dir}",
        "weight_sync.backend=nccl", "trainer.total_steps=6",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == list(range(1, 7))
    assert all(m["staleness_max"] <= 1 for m in metrics)
    events = [json.loads(line) for line in (run_dir / "logs" / "rollout-0.jsonl").read_text().splitlines()]
    joined = [e for e in events if e["event"] == "weight_group_joined"]
    assert len(joined) == 1 and joined[0]["backend"] == "gloo"
    assert [e["version"] for e in events if e["event"] == "weights_applied"] == list(range(1, 7))
