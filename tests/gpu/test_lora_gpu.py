"""LoRA on one H200: the 1.54B bench model, async, 10 steps, LoRA and full fine-tuning back
to back (benchmarks/lora.py, the command BENCHMARKS.md records). Checks what the issue asks
to record: each LoRA update moves only the adapter and is faster than the full one, the
trainer needs less memory, and the rollout samples from the adapter the trainer holds.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest -m gpu tests/gpu/test_lora_gpu.py -s -o addopts=""
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.harness import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_lora_updates_are_the_adapter_and_the_trainer_needs_less_memory(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    cmd = [sys.executable, "benchmarks/lora.py", "--config", "configs/bench_1.5b.yaml", "--run-root",
           str(tmp_path / "runs"), "--timeout-s", "300", "--out", str(out), "trainer.total_steps=10"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(out.read_text())
    lora, full = result["variants"]["lora"], result["variants"]["full"]
    print(json.dumps(result["lora_over_full"]))
    # rank 16 on 7 projections x 28 layers of the 1.54B shape: 18.5M parameters, 36.9 MB in bf16
    assert lora["update_gb"] == pytest.approx(0.0369, rel=0.02) and full["update_gb"] > 3.0
    assert lora["weight_sync_s"] < full["weight_sync_s"]
    assert lora["trainer_peak_gb"] < 0.8 * full["trainer_peak_gb"]
    runs = Path(result["run_root"])
    for name in ("lora", "full"):
        steps = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        assert len(steps) == 10 and max(s["kl_behaviour_proximal"] for s in steps) < 1e-2, name
