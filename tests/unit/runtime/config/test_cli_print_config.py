"""`tandem launch CONFIG [overrides] --print-config`: the resolved config as YAML (every
default filled in, every override applied: what RUN_DIR/config.yaml would hold), exit 0,
and nothing made or started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import yaml

from runtime.config.load import load_config
from tests.conftest import ROOT


def launch(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "runtime.cli", "launch", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_print_config_prints_the_resolved_config_and_starts_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [f"run_dir={run}", "rollout.n=4", "trainer.fsdp.param_dtype=bfloat16"]
    done = launch("configs/tiny_cpu.yaml", *overrides, "--print-config")
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed == msgspec.to_builtins(load_config("configs/tiny_cpu.yaml", overrides))
    assert printed["rollout"]["n"] == 4 and printed["fsdp"]["param_dtype"] == "bfloat16"  # overrides, alias too
    assert printed["startup_timeout_s"] == 300.0 and "weight_sync" in printed  # defaults the recipe never names
    assert not run.exists()  # no run directory, no tiny model, no role

    # What it prints is a recipe: launching it is launching the original.
    (tmp_path / "resolved.yaml").write_text(done.stdout)
    again = launch(str(tmp_path / "resolved.yaml"), "--print-config")
    assert again.returncode == 0 and yaml.safe_load(again.stdout) == printed


def test_print_config_with_a_bad_override_is_a_one_line_error() -> None:
    done = launch("configs/tiny_cpu.yaml", "rollout.nn=4", "--print-config")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("tandem: error: unknown config key 'rollout.nn'") and done.stderr.count("\n") == 1
