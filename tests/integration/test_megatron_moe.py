"""A Qwen3-MoE as a real megatron-core `GPTModel` on CPU (tests/helpers/megatron_moe_cpu.py,
one gloo rank, fp32): its logits equal transformers' on the same weights; the HF weights go
in and come back bit for bit under the per-expert checkpoint names; routing replay routes to
exactly the given experts (mismatch 0, and 0 disagreement when the routers' own choice is
replayed, which changes no logit); the gradient reaches every router through a replayed
forward. The Megatron engine's own micro-batch hooks line the rollout's routing up with
megatron's sequence-first rows, replay it, and report the FSDP2 actor's routing figures (its
optimizer and schedule make CUDA tensors: the steps themselves run on the GPU,
tests/gpu/test_megatron_moe_gpu.py). About a minute on 2 cores: `slow`. The layout arithmetic
alone is tests/unit/roles/training/test_megatron_convert.py."""

from __future__ import annotations

import json
import subprocess
import sys

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


@pytest.fixture(scope="module")
def engine_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("megatron.core", reason="megatron-core is installed by .ci/setup")
    model = make_tiny_model(tmp_path_factory.mktemp("megatron-moe-engine") / "m", num_experts=8, num_experts_per_tok=2)
    cmd = [sys.executable, "-m", "tests.helpers.megatron_moe_cpu", str(model), "engine"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    return result


def test_megatron_engine_measures_no_disagreement_with_transformers_own_routing(engine_result: dict) -> None:
    """The engine's micro-batches (padded, several) carry the rollout's experts in the model
    input's order and megatron routes sequence-first: the rows line up, so transformers' own
    routing of the same tokens is what the engine's routers choose."""
    own = engine_result["own"]
    assert own["micro_batches"] > 1
    assert own["routed_tokens"] == 88.0  # every token but each sequence's last
    assert own["router_disagree"] == 0.0 and own["routing_mismatch"] == 0.0
    assert own["router_aux_loss"] > 0.0


def test_megatron_engine_replays_random_experts_and_trains_its_routers(engine_result: dict) -> None:
    replayed = engine_result["replayed"]
    assert replayed["routing_mismatch"] == 0.0
    assert replayed["router_disagree"] > 0.5
    assert all(g > 0.0 for g in replayed["router_grad_norms"])
    for name in ("routed_rows", "router_disagree_rows", "routing_mismatch_rows", "router_aux_loss"):
        assert name in engine_result["metric_names"]
