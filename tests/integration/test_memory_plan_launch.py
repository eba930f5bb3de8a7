"""`tandem launch --plan` and the launcher's memory check, as a user runs them (real CLI
processes): the plan of a recipe for a GPU this machine does not have, its exit codes, and
a run that cannot fit refused in one line before any role starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

TANDEM = [sys.executable, "-m", "runtime.cli", "launch"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TANDEM, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_plan_of_each_recipe_fits_80_and_141_gb_with_what_auto_chose() -> None:
    for config, params in [("bench_1.5b", "1.54B"), ("bench_3b", "3.09B"), ("bench_7b_lora", "7.62B")]:
        for gpu_gb in (80, 141):
            out = _run("--plan", f"configs/{config}.yaml", f"memory.gpu_gb={gpu_gb}")
            assert out.returncode == 0, out.stdout + out.stderr
            assert out.stdout.startswith(f"memory plan: {params}-parameter policy"), out.stdout
            assert "= all at once: " in out.stdout and "DOES NOT FIT" not in out.stdout
            assert "trainer-0    peak (cuda_peak_gb)" in out.stdout
            assert "\nauto: trainer.micro_batch_tokens=" in out.stdout


def test_plan_that_does_not_fit_exits_2_with_one_line() -> None:
    out = _run("--plan", "configs/bench_1.5b.yaml", "memory.gpu_gb=80", "trainer.micro_batch_tokens=65536")
    assert out.returncode == 2
    assert "DOES NOT FIT" in out.stdout  # the table is printed all the same
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("tandem: error: memory plan: GPU 0 of node 0 needs ")
    assert "; it fits with " in line or "; no single setting makes it fit" in line


def test_launch_that_cannot_fit_is_refused_before_any_role_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = _run("configs/tiny_cpu.yaml", f"run_dir={run_dir}", "memory.host_gb=0.5")
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("tandem: error: memory plan: host memory of node 0: needs "), line
    assert "largest: rollout-0" in line
    assert not (run_dir / "logs").exists()  # no role was started, nothing was written
    skipped = _run("--plan", "configs/tiny_cpu.yaml", "memory.host_gb=0.5", "memory.check=false")
    assert skipped.returncode == 2  # --plan always checks; memory.check=false only lets a launch go on
