"""`rollout.seeded_sampling`: a synchronous tiny run repeats bit for bit on CPU, however
vLLM batches its requests, single-turn and multi-turn (each later turn seeded afresh). The
two runs of each recipe batch differently on purpose (the second lets at most two groups
into vLLM at once, the first all of a step's), so without a seed per sample they draw
different tokens from step 1 on (vLLM's shared generator is consumed in batch order)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
SEEDED = ["rollout.seeded_sampling=true", "rollout.max_staleness=0", "trainer.total_steps=4"]
SAME = ("loss", "grad_norm", "reward_mean", "response_len_mean", "entropy", "kl_behaviour_proximal")


def steps(recipe: str, run_dir: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "runtime.cli", "launch", recipe, f"run_dir={run_dir}", *SEEDED, *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "kind" not in r]  # validation records aside


@pytest.mark.parametrize("recipe", ["configs/tiny_cpu.yaml", "configs/multiturn_tiny_cpu.yaml"])
def test_seeded_sync_runs_repeat_bit_for_bit_whatever_vllm_batches(recipe: str, tmp_path: Path) -> None:
    wide = steps(recipe, tmp_path / "wide")
    narrow = steps(recipe, tmp_path / "narrow", "rollout.engine.max_num_seqs=16")
    assert [m["step"] for m in wide] == [m["step"] for m in narrow] == [1, 2, 3, 4]
    for a, b in zip(wide, narrow, strict=True):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}, f"step {a['step']}"
