"""benchmarks/scaling.py: the points of each axis are the documented shapes and lengths, each
loads and validates, and the memory plan's refusal of a point that cannot fit is its reason."""

from __future__ import annotations

import msgspec
import pytest

from benchmarks.async_vs_sync import decoder_param_count
from benchmarks.scaling import points, refusal
from runtime.config_load import load_config


def _params(cfg) -> int:  # type: ignore[no-untyped-def]
    t = msgspec.structs.asdict(cfg.model.tiny)
    hf = {"model_type": "qwen2", "hidden_size": t["hidden_size"], "num_hidden_layers": t["num_layers"],
          "num_attention_heads": t["num_heads"], "num_key_value_heads": t["num_kv_heads"],
          "intermediate_size": t["intermediate_size"], "vocab_size": t["vocab_size"] or 259,
          "tie_word_embeddings": t["tie_word_embeddings"]}  # fmt: skip
    return decoder_param_count(hf)


def test_model_axis_has_the_four_shapes() -> None:
    pts = points("model", "h200", 1.0)
    assert [p.name for p in pts] == ["0.5b", "1.5b", "3b", "7b"]
    sizes = [_params(load_config(p.config, p.overrides)) / 1e9 for p in pts]
    # Qwen2.5-0.5B: 0.49B; the 1.5B bench shape 1.54B; 3B 3.09B; 7B 7.62B
    assert sizes == pytest.approx([0.494, 1.544, 3.086, 7.616], rel=0.01)
    half = load_config(pts[0].config, pts[0].overrides).model.tiny
    shape = (half.hidden_size, half.num_layers, half.num_heads, half.num_kv_heads, half.intermediate_size)
    assert shape == (896, 24, 14, 2, 4864) and half.vocab_size == 151936


def test_length_axis_budgets_and_room() -> None:
    pts = points("length", "h200", 1.0)
    assert [p.x for p in pts] == [512, 2048, 8192]
    for p in pts:
        cfg = load_config(p.config, p.overrides)
        r = cfg.rollout
        assert (r.length_dist.kind, r.length_dist.mean_tokens, r.max_tokens) == ("lognormal", p.x, 4 * p.x)
        assert r.ignore_eos and r.engine.max_model_len > r.max_tokens
        assert cfg.model.tiny.max_position_embeddings >= r.engine.max_model_len
        assert cfg.trainer.micro_batch_tokens >= r.engine.max_model_len


def test_a_point_that_cannot_fit_is_refused_with_the_plans_reason() -> None:
    seven = points("model", "h200", 1.0)[3]
    why = refusal(load_config(seven.config, [*seven.overrides, "memory.gpu_gb=40", "memory.host_gb=512"]))
    assert why is not None and why.startswith("memory plan: GPU 0 of node 0 needs ")
    assert refusal(load_config(seven.config, [*seven.overrides, "memory.gpu_gb=141", "memory.host_gb=512"])) is None
    assert refusal(load_config("configs/tiny_cpu.yaml")) is None
