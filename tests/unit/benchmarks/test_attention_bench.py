"""benchmarks/attention.py on the CPU (--quick): a real process, the engine's own attention
path beside SDPA on a batch with nothing padded; the FLOP count worked out by hand; the
CUDA-only kernels and the padded kernel on mixed lengths recorded with their reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.attention import attention_flops, parse_args
from tests.conftest import ROOT


def test_quick_run_compares_the_engines_kernel_with_sdpa(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "benchmarks/attention.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result and result["device"] == "cpu"
    fixed = result["cases"]["fixed_4k"]
    assert (fixed["sequences"], fixed["longest"], fixed["tokens"]) == (4, 64, 256)
    assert fixed["attention_flops"] == 6 * 4 * 64**2 * 12 * 128  # 6 x sum(len^2) x heads x dim
    torch_k, padded = fixed["kernels"]["torch"], fixed["kernels"]["sdpa_padded"]
    assert torch_k["fwd_ms"] > 0 and torch_k["fwd_bwd_ms"] > 0 and torch_k["vs_torch"] == 1.0
    assert padded["fwd_bwd_ms"] > 0 and padded["tflops"] > 0
    assert 0 < padded["max_rel_diff"] < 0.03  # the same attention, rounded differently in bf16
    for name in ("fa4", "cudnn", "cudnn_repeat"):
        error = fixed["kernels"][name]["error"]
        assert error.startswith("ValueError: ") and "CUDA GPU" in error
    mix = result["cases"]["length_mix"]
    assert len(set(mix["kernels"])) == 5 and mix["kernels"]["torch"]["fwd_bwd_ms"] > 0
    assert "one length" in mix["kernels"]["sdpa_padded"]["error"]


def test_flops_and_arguments() -> None:
    assert attention_flops([3, 5], heads=2, head_dim=4) == 6 * (9 + 25) * 2 * 4
    with pytest.raises(SystemExit):
        parse_args(["--kernels", "sdpa_padded", "torch"])  # torch first: the others are compared with it
    with pytest.raises(SystemExit):
        parse_args(["--heads", "12", "--kv-heads", "5"])
