"""HF <-> megatron-core weight layout: pure conversions (bit-exact both ways, every TP and PP
split). The real `GPTModel` built on CPU over gloo is tests/integration/test_megatron_models.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from roles.megatron.convert import (
    ModelDims,
    check_divisible,
    fuse_qkv,
    hf_to_megatron,
    megatron_layer_to_hf,
    megatron_top_to_hf,
    split_qkv,
    stage_layers,
    tp_shard,
    tp_unshard,
)


def dims(**kw: object) -> ModelDims:
    base = dict(hidden=8, layers=4, heads=4, kv_heads=2, head_dim=2, ffn=12, vocab=11, tied=False, qkv_bias=True,
                rope_theta=1e6, norm_eps=1e-6, max_positions=64)  # fmt: skip
    base.update(kw)
    return ModelDims(**base)  # type: ignore[arg-type]


def random_hf(d: ModelDims) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    hf = {"model.embed_tokens.weight": r(d.vocab, d.hidden), "model.norm.weight": r(d.hidden)}
    if not d.tied:
        hf["lm_head.weight"] = r(d.vocab, d.hidden)
    for i in range(d.layers):
        p = f"model.layers.{i}."
        if d.experts:
            hf.update(random_moe_layer(d, p, r))
            continue
        hf.update({
            p + "input_layernorm.weight": r(d.hidden), p + "post_attention_layernorm.weight": r(d.hidden),
            p + "self_attn.q_proj.weight": r(q, d.hidden), p + "self_attn.k_proj.weight": r(kv, d.hidden),
            p + "self_attn.v_proj.weight": r(kv, d.hidden), p + "self_attn.o_proj.weight": r(d.hidden, q),
            p + "mlp.gate_proj.weight": r(d.ffn, d.hidden), p + "mlp.up_proj.weight": r(d.ffn, d.hidden),
            p + "mlp.down_proj.weight": r(d.hidden, d.ffn),
        })  # fmt: skip
        if d.qkv_bias:
            hf.update({p + "self_attn.q_proj.bias": r(q), p + "self_attn.k_proj.bias": r(kv),
                       p + "self_attn.v_proj.bias": r(kv)})  # fmt: skip
    return hf


def random_moe_layer(d: ModelDims, p: str, r: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """One Qwen3-MoE layer by HF checkpoint name: attention with q/k norms, router, experts."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    hf = {
        p + "input_layernorm.weight": r(d.hidden), p + "post_attention_layernorm.weight": r(d.hidden),
        p + "self_attn.q_proj.weight": r(q, d.hidden), p + "self_attn.k_proj.weight": r(kv, d.hidden),
        p + "self_attn.v_proj.weight": r(kv, d.hidden), p + "self_attn.o_proj.weight": r(d.hidden, q),
        p + "self_attn.q_norm.weight": r(d.head_dim), p + "self_attn.k_norm.weight": r(d.head_dim),
        p + "mlp.gate.weight": r(d.experts, d.hidden),
    }  # fmt: skip
    for e in range(d.experts):
        x = f"{p}mlp.experts.{e}."
        hf.update({x + "gate_proj.weight": r(d.moe_ffn, d.hidden), x + "up_proj.weight": r(d.moe_ffn, d.hidden),
                   x + "down_proj.weight": r(d.hidden, d.moe_ffn)})  # fmt: skip
    return hf


def moe_dims(**kw: object) -> ModelDims:
    return dims(qkv_bias=False, experts=4, top_k=2, moe_ffn=6, qk_norm=True, **kw)


def round_trip(hf: dict[str, torch.Tensor], d: ModelDims, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """HF -> per-stage Megatron -> TP shards -> unsharded -> HF, as the engine does it."""
    out: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        mg = dict(hf_to_megatron(hf.__getitem__, d, stage=stage, pp=pp, tp=tp))
        for name, full in mg.items():
            assert tuple(full.shape) == d.full_shape(name, tp)
        mg = {n: tp_unshard(n, [tp_shard(n, t, r, tp) for r in range(tp)]) for n, t in mg.items()}
        for j, i in enumerate(stage_layers(d, stage, pp)):
            layer = {s: mg[f"decoder.layers.{j}.{s}"] for s in d.layer_suffixes()}
            out.update(megatron_layer_to_hf(layer, i, d))
        for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight"):
            if name in mg:
                out.__setitem__(*megatron_top_to_hf(name, mg[name], d))
        if "output_layer.weight" in mg and not d.tied:
            out.__setitem__(*megatron_top_to_hf("output_layer.weight", mg["output_layer.weight"], d))
    return out


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_hf_to_megatron_to_hf_is_bit_exact(tp: int, pp: int, tied: bool) -> None:
    d = dims(tied=tied, qkv_bias=not tied)  # Qwen2-like (bias, tied) and Llama-like (no bias, untied)
    hf = random_hf(d)
    back = round_trip(hf, d, tp, pp)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_qkv_is_grouped_by_kv_head() -> None:
    d = dims(heads=4, kv_heads=2, head_dim=1, hidden=1)
    q, k, v = torch.arange(4.0)[:, None], 10 + torch.arange(2.0)[:, None], 20 + torch.arange(2.0)[:, None]
    fused = fuse_qkv(q, k, v, d)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1 -- megatron's layout, so TP splits by group.
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, d), (q, k, v), strict=True))


def test_tp_shards_of_fc1_hold_matching_gate_and_up_rows() -> None:
    gate, up = torch.arange(4.0)[:, None], 100 + torch.arange(4.0)[:, None]
    fc1 = torch.cat([gate, up])
    shards = [tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, r, 2) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 100, 101]
    assert shards[1].flatten().tolist() == [2, 3, 102, 103]


def test_vocab_is_padded_to_the_tp_size_with_zero_rows() -> None:
    d = dims(vocab=11)
    hf = random_hf(d)
    mg = dict(hf_to_megatron(hf.__getitem__, d, tp=2))
    emb = mg["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 12 and torch.equal(emb[:11], hf["model.embed_tokens.weight"]) and not emb[11:].any()


def test_unsupported_architectures_are_named() -> None:
    from transformers import MistralConfig, Qwen2Config

    with pytest.raises(ValueError, match=r"model_type 'mistral' is not supported .* qwen2, llama"):
        ModelDims.from_hf_config(MistralConfig())
    scaled = Qwen2Config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ValueError, match=r"rope scaling .* is not supported"):
        ModelDims.from_hf_config(scaled)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=3 must divide the 4 layers"):
        list(stage_layers(dims(), 0, 3))


@pytest.mark.parametrize(("tied", "pp"), [(True, 1), (False, 1), (False, 2)])
def test_moe_hf_to_megatron_to_hf_is_bit_exact(tied: bool, pp: int) -> None:
    """Qwen3-MoE: q/k norms, router and every expert (fused `[gate; up]` in megatron) come
    back under the per-expert HF checkpoint names, bit for bit."""
    d = moe_dims(tied=tied)
    hf = random_hf(d)
    back = round_trip(hf, d, 1, pp)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_moe_experts_fuse_gate_and_up_per_expert() -> None:
    d = moe_dims(layers=1)
    hf = random_hf(d)
    mg = dict(hf_to_megatron(hf.__getitem__, d))
    fc1 = mg["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    want = torch.cat(
        [hf["model.layers.0.mlp.experts.3.gate_proj.weight"], hf["model.layers.0.mlp.experts.3.up_proj.weight"]]
    )
    assert torch.equal(fc1, want)
    assert torch.equal(mg["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    assert torch.equal(
        mg["decoder.layers.0.self_attention.q_layernorm.weight"], hf["model.layers.0.self_attn.q_norm.weight"]
    )
    assert not any("linear_fc1" in n and "experts" not in n for n in mg)


def test_qwen3_moe_config_reads_its_experts_and_refuses_what_megatron_does_not_build() -> None:
    from transformers import Qwen3MoeConfig

    base = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=6, norm_topk_prob=True)  # fmt: skip
    d = ModelDims.from_hf_config(Qwen3MoeConfig(**base))
    assert (d.experts, d.top_k, d.moe_ffn, d.qk_norm, d.norm_topk, d.qkv_bias) == (8, 2, 6, True, True, False)
    assert d.full_shape("decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight", 1) == (12, 16)
    assert d.full_shape("decoder.layers.1.mlp.router.weight", 1) == (8, 16)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelDims.from_hf_config(Qwen3MoeConfig(**base, mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelDims.from_hf_config(Qwen3MoeConfig(**base, attention_bias=True))
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2: a mixture-of-experts policy trains with TP=1"):
        check_divisible(d, 2, "trainer.megatron")
    check_divisible(d, 1, "trainer.megatron")
