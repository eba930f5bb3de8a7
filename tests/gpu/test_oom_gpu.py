"""Running out of GPU memory mid-run is a clear error that ends the run, on ONE GPU.

    python3 -m pytest -m gpu tests/gpu/test_oom_gpu.py -s -o addopts=""

A synchronous colocated run (vLLM and the trainer on GPU 0, vLLM asleep while the trainer
steps). Once vLLM has gone to sleep, this test takes all but 4 GB of the GPU's free memory:
the trainer's tiny step still fits, vLLM's KV cache cannot wake. The run must end, within
30 s of that, with the cause naming the rollout, the wake-up and the memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
COLOCATED = ("placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
             " {role: trainer, count: 1, devices: [0]}]")  # fmt: skip


def _slept(log: Path) -> bool:
    return log.exists() and any('"engine_sleeping"' in line for line in log.read_text().splitlines())


def test_rollout_out_of_memory_at_wake_up_ends_the_run_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "oom"
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", f"run_dir={run_dir}",
           COLOCATED,
           "trainer.device=cuda", "rollout.max_staleness=0", "trainer.total_steps=1000",
           "rollout.engine.enforce_eager=true", "rollout.engine.gpu_memory_utilization=0.3"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not _slept(run_dir / "logs" / "rollout-0.jsonl"):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "vLLM never went to sleep"
            time.sleep(0.2)
        free, _ = torch.cuda.mem_get_info(0)
        hog = torch.empty(int(free - 4e9), dtype=torch.uint8, device="cuda:0")
        taken = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        ended = time.monotonic() - taken
        print(f"took {hog.numel() / 1e9:.1f} GB; the run ended {ended:.1f} s later, exit {proc.returncode}")
        print(out[-3000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert ended < 30, ended
    assert "rollout-0 ran out of GPU memory in vLLM wake_up" in out, out[-3000:]
    assert "GB free" in out and "tandem launch --plan" in out
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert len(steps) < 1000  # it did not finish as a success
