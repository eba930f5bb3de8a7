"""The async loop on CUDA: the same roles and config as the CPU run, only placed on GPUs.

Needs 2 NVIDIA GPUs: `python -m pytest -m gpu tests/gpu`. Results of the GPU runs (GPU,
commit, date) are in docs/gpu-verification.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2), pytest.mark.slow]

# Engine options for a quick start on GPU: no torch.compile / CUDA graphs for the tiny model.
GPU_ENGINE = ("rollout.engine.enforce_eager=true", "rollout.engine.gpu_memory_utilization=0.3")
SPLIT = (
    "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
    " {role: trainer, count: 1, devices: [1]}]"
)
COLOCATED = (
    "placement=[{role: controller}, {role: reward}, {role: rollout, devices: [0]},"
    " {role: trainer, count: 2, devices: [0, 1]}]"
)


def launch(run_dir: Path, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "launch",
        "configs/tiny_cpu.yaml",
        f"run_dir={run_dir}",
        *overrides,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:] + role_tracebacks(run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def role_tracebacks(run_dir: Path) -> str:
    """What the launcher's one line leaves out: each role's last logged traceback and the
    end of its captured output (vLLM writes an engine's root cause there)."""
    found = []
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        texts = [r.get("text", "") for r in records if r.get("event") == "traceback"]
        if texts:
            found.append(f"\n--- {path.stem} traceback:\n{texts[-1][-2500:]}")
    for path in sorted((run_dir / "logs").glob("*.out")):
        tail = path.read_text(errors="replace")[-1500:]
        if "Error" in tail:
            found.append(f"\n--- {path.name}:\n{tail}")
    return "".join(found)


def test_async_grpo_rollout_on_gpu0_fsdp2_on_gpu1(tmp_path: Path) -> None:
    metrics = launch(tmp_path / "split", *GPU_ENGINE, SPLIT, "trainer.device=cuda", "rollout.max_staleness=2")
    assert len(metrics) == 40
    assert all(m["staleness_max"] <= 2 for m in metrics)
    q = len(metrics) // 4
    first = sum(m["reward_mean"] for m in metrics[:q]) / q
    last = sum(m["reward_mean"] for m in metrics[-q:]) / q
    assert last > first + 0.05, (first, last)
    ready = [json.loads(line) for line in (tmp_path / "split" / "logs" / "trainer-0.jsonl").read_text().splitlines()]
    assert any(e.get("device", "").startswith("cuda") for e in ready), "the trainer did not run on CUDA"


def test_colocated_rollout_and_trainer_share_gpu0(tmp_path: Path) -> None:
    overrides = (COLOCATED, "trainer.device=cuda", "rollout.max_staleness=0", "trainer.total_steps=10")
    metrics = launch(tmp_path / "colo", *GPU_ENGINE, *overrides)
    assert len(metrics) == 10
    assert all(m["staleness_max"] == 0 for m in metrics)
