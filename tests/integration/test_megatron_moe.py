"""A Qwen3-MoE as a real megatron-core `GPTModel` on CPU (tests/helpers/megatron_moe_cpu.py,
one gloo rank, fp32): its logits equal transformers' on the same weights; the HF weights go
in and come back bit for bit under the per-expert checkpoint names; routing replay routes to
exactly the given experts (mismatch 0, and 0 disagreement when the routers' own choice is
replayed, which changes no logit); the gradient reaches every router through a replayed
forward. The Megatron engine itself (megatron's DDP, optimizer and schedule) trains it with
routing replayed, lines the rollout's routing up with megatron's sequence-first rows, reports
the FSDP2 actor's routing figures, and resumes from its checkpoint to the same losses and
weights. About two minutes on 2 cores: `slow`. The layout arithmetic
alone is tests/unit/roles/training/test_megatron_convert.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.tiny.model import make_tiny_model
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("megatron.core", reason="megatron-core is installed by .ci/setup")
    model = make_tiny_model(tmp_path_factory.mktemp("megatron-moe") / "m", num_experts=8, num_experts_per_tok=2)
    cmd = [sys.executable, "-m", "tests.helpers.megatron_moe_cpu", str(model)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps({k: v for k, v in result.items() if k not in ("exported", "expected")}))
    return result


def test_megatron_moe_logits_equal_transformers(moe_result: dict) -> None:
    assert moe_result["max_logit_diff"] < 1e-4
    assert moe_result["argmax_agree"] == 1.0


def test_megatron_moe_exports_the_hf_weights_bit_exact(moe_result: dict) -> None:
    assert moe_result["exported"] == moe_result["expected"]
    assert moe_result["differ"] == []
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in moe_result["exported"]


def test_megatron_moe_replays_the_given_experts(moe_result: dict) -> None:
    assert moe_result["replayed_equals_given"]
    assert moe_result["replay_mismatch"] == 0.0
    assert moe_result["replay_compared"] == 50.0  # the real rows of the padded batch
    assert moe_result["replay_disagree"] > 0.0  # random experts differ from the routers' own


def test_megatron_moe_replaying_its_own_routing_changes_nothing(moe_result: dict) -> None:
    assert moe_result["own_replay_mismatch"] == 0.0
    assert moe_result["own_replay_disagree"] == 0.0
    assert moe_result["own_replay_logit_diff"] == 0.0


def test_megatron_moe_gradient_reaches_every_router(moe_result: dict) -> None:
    assert len(moe_result["router_grad_norms"]) == 2
    assert all(g > 0.0 for g in moe_result["router_grad_norms"])
    assert moe_result["aux_loss"] > 0.0


def train(model: Path, phase: str, directory: Path) -> dict:
    cmd = [sys.executable, "-m", "tests.helpers.megatron_moe_cpu", str(model), "train", phase, str(directory)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The engine's steps 1-4 with a checkpoint after step 2, and steps 3-4 of a fresh engine
    that loaded it."""
    pytest.importorskip("megatron.core", reason="megatron-core is installed by .ci/setup")
    root = tmp_path_factory.mktemp("megatron-moe-engine")
    model = make_tiny_model(root / "m", num_experts=8, num_experts_per_tok=2)
    return train(model, "save", root / "ckpt"), train(model, "load", root / "ckpt")


def test_megatron_engine_trains_a_moe_replaying_the_rollouts_routing(trained: tuple[dict, dict]) -> None:
    """Step 1's batch carries transformers' own routing of its tokens: the engine's micro-batches
    (padded, in the model input's order) line up with megatron's sequence-first rows, so its
    routers agree on every token. Later steps replay random experts: mismatch 0, and they train."""
    steps = trained[0]["steps"]
    assert steps["1"]["routed_tokens"] == 88.0  # every token but each sequence's last
    assert steps["1"]["router_disagree"] == 0.0
    for i in ("1", "2", "3", "4"):
        assert steps[i]["routing_mismatch"] == 0.0
        assert steps[i]["router_aux_loss"] > 0.0 and steps[i]["grad_norm"] > 0.0
    assert steps["2"]["router_disagree"] > 0.5
    assert steps["4"]["loss"] < steps["1"]["loss"]


def test_megatron_moe_engine_resumes_exactly(trained: tuple[dict, dict]) -> None:
    saved, loaded = trained
    assert loaded["version"] == saved["version"] == 4
    for i in ("3", "4"):
        assert loaded["steps"][i] == saved["steps"][i]
    assert loaded["weight_sum"] == saved["weight_sum"]
