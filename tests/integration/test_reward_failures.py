"""Reward functions that cannot work end the run naming them: one
whose signature no reward call can satisfy is refused before anything starts (exit 2, one
line), and one that fails on every call ends the run at its first step, instead of a
"successful" run that trained on rewards of 0."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

TANDEM = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml"]


def test_a_reward_function_with_an_impossible_signature_is_refused_before_start(tmp_path: Path) -> None:
    started = time.monotonic()
    out = subprocess.run(
        [*TANDEM, f"run_dir={tmp_path / 'run'}", "reward.functions=[tests.helpers.rewards:wrong_signature]"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and "tests.helpers.rewards:wrong_signature" in line and "'text'" in line
    assert time.monotonic() - started < 15  # python start and imports; no role was spawned
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.slow
def test_a_reward_function_failing_on_every_call_ends_the_run_naming_it(tmp_path: Path) -> None:
    out = subprocess.run(
        [*TANDEM, f"run_dir={tmp_path / 'run'}", "trainer.total_steps=4",
         "reward.functions=[tests.helpers.rewards:always_raises]"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:]
    assert "got no reward" in out.stdout and "tests.helpers.rewards:always_raises KeyError" in out.stdout, out.stdout[
        -3000:
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
