"""The Megatron engine on a tiny Qwen3-MoE, one GPU (megatron-core's engine trains on CUDA;
the model alone is checked on CPU in tests/integration/test_megatron_moe.py):

    python3 -m pytest -m gpu tests/gpu/test_megatron_moe_gpu.py -s -o addopts=""

* the engine's token logprobs equal transformers' on the same weights (fp32), before and
  after training (the trained export, loaded by transformers);
* a step whose batch carries transformers' own routing, `routing_replay: measure`: the
  router agrees with it (disagreement and mismatch 0);
* steps replaying random experts (`rollout`): mismatch 0, disagreement near 1 - the chance
  of drawing the same pair, a load-balancing loss, a finite loss and a gradient;
* the export holds every HF name of the model directory (per-expert names);
* save after 2 steps, load in a fresh process: steps 3-4 train to the same loss, gradient
  norm and weights (tests/gpu/megatron_worker.py's resume case on the MoE model).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.tiny.model import make_tiny_model
from tests.conftest import ROOT
from tests.helpers.ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def torchrun(module: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           "-m", module, *args]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mg-moe") / "model", num_experts=8, num_experts_per_tok=2)


def test_megatron_engine_trains_a_moe_with_routing_replay(moe_model: Path, tmp_path: Path) -> None:
    torchrun("tests.gpu.megatron_moe_worker", str(moe_model), str(tmp_path))
    r = json.loads((tmp_path / "result.json").read_text())
    print(json.dumps({k: v for k, v in r.items() if k not in ("exported", "expected")}))
    assert r["logprob_max_abs_diff"] < 2e-3
    assert r["trained_logprob_max_abs_diff"] < 2e-3
    assert r["own"]["router_disagree"] == 0.0 and r["own"]["routing_mismatch"] == 0.0
    for step in r["replayed"]:
        assert step["routing_mismatch"] == 0.0
        assert step["router_disagree"] > 0.5
        assert step["router_aux_loss"] > 0.0 and math.isfinite(step["loss"]) and step["grad_norm"] > 0.0
    assert r["exported"] == r["expected"]


def test_megatron_moe_engine_resumes_exactly(moe_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for phase in ("save", "load"):
        torchrun("tests.gpu.megatron_worker", "resume", str(moe_model), str(out), phase, "false")
    saved, loaded = (json.loads((out / f"{p}.json").read_text()) for p in ("save", "load"))
    print(json.dumps({"save": saved["steps"], "load": loaded["steps"]}))
    assert (loaded["version"], loaded["optimizer_steps"]) == (2, 2)
    for i in ("3", "4"):
        for k, v in saved["steps"][i].items():
            assert loaded["steps"][i][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (i, k)
    assert loaded["weight_sum"] == pytest.approx(saved["weight_sum"], rel=1e-6)
