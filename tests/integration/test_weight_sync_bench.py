"""benchmarks/weight_sync.py end to end in its `--quick` mode on the CPU: every backend this
machine allows (zmq, and nccl over gloo) into a real rollout role, one JSON object out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_weight_sync_benchmark_quick() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--quick", "--busy", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "weight_sync"
    rows = result["backends"]
    assert set(rows) == {"zmq", "nccl", "zmq:busy", "nccl:busy"}
    for name in ("zmq:busy", "nccl:busy"):
        assert rows[name]["busy_tok_per_s"] > 0 and rows[name]["busy_groups"] == 2, name
    for name, row in rows.items():
        assert row["updates"] == 2 and row["update_s_median"] > 0 and row["gb"] > 0, name
        assert set(row["phases_s_median"]) == {"gather_s", "transfer_s", "load_s"}
        assert row["phases_s_median"]["load_s"] > 0
    assert rows["zmq"]["speedup_vs_zmq"] == 1.0
