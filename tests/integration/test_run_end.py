"""The README's first command, shortened, from a fresh run directory: the run ends with a
summary naming a model directory that `tandem export` accepts; the directory is then the
run's own: a launch without `resume` is refused, and `resume=auto` of the finished run
ends at once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.test_tiny_run import run_tiny

pytestmark = pytest.mark.slow
STEPS = 3
TANDEM = [sys.executable, "-m", "runtime.cli"]


def test_a_tiny_run_ends_with_a_model_that_export_accepts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    metrics, stdout = run_tiny(run, f"trainer.total_steps={STEPS}")  # checkpoint.every is 0: the final one only
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert re.search(rf"tandem: finished: wall \S+, step {STEPS}, reward_mean \d\.\d{{3}}", stdout), stdout[-2000:]
    assert f"run directory  {run}" in stdout
    model = Path(re.findall(r"model +(\S+)", stdout)[-1])
    assert model == run / "checkpoints" / f"step-{STEPS:08d}" / "hf" and model.is_dir(), stdout[-2000:]
    assert f"tandem report {run}" in stdout and f"tandem export {run} OUT_DIR" in stdout

    out = subprocess.run([*TANDEM, "export", str(run), str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()

    again = [*TANDEM, "launch", "configs/tiny_cpu.yaml", f"run_dir={run}", f"trainer.total_steps={STEPS}"]
    out = subprocess.run(again, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "holds an earlier run" in out.stderr and "resume=auto" in out.stderr, out.stderr
    out = subprocess.run([*again, "resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "the run is finished" in out.stdout, out.stdout + out.stderr
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"kind"' not in line]) == STEPS  # nothing appended
