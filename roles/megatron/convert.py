"""HF (Qwen2 / Llama / Qwen3-MoE) <-> megatron-core `GPTModel` weight layout, as pure tensor functions.

Checkpoint format consistency, what a caller may rely on:

* Names. HF `model.embed_tokens.weight` <-> `embedding.word_embeddings.weight`;
  `model.layers.{i}.input_layernorm.weight` <-> `decoder.layers.{j}.input_layernorm.weight`;
  `post_attention_layernorm` <-> `pre_mlp_layernorm`; `self_attn.o_proj` <->
  `self_attention.linear_proj`; `mlp.down_proj` <-> `mlp.linear_fc2`; `model.norm` <->
  `decoder.final_layernorm`; `lm_head` <-> `output_layer` (absent when embeddings are
  tied). `j` is the layer's index inside its pipeline stage: stage `s` of `pp` holds global
  layers `[s * L/pp, (s + 1) * L/pp)`.
* Fusions. `linear_qkv` holds q, k and v grouped by KV head: for each of the `kv_heads`
  groups, its `heads/kv_heads` query heads, then its key head, then its value head (rows of
  `head_dim`); the bias (Qwen2) likewise. `linear_fc1` is `[gate; up]`.
* Mixture of experts (Qwen3-MoE). `self_attn.q_norm` / `k_norm` <-> `self_attention.q_layernorm` /
  `k_layernorm`; the router `mlp.gate.weight` <-> `mlp.router.weight`; expert `e`'s
  `mlp.experts.{e}.gate_proj` / `up_proj` fuse into `mlp.experts.local_experts.{e}.linear_fc1`
  (`[gate; up]`) and its `down_proj` is `linear_fc2`. Exported under the per-expert names of HF
  checkpoints (`roles/training/moe.py` `checkpoint_items`), which vLLM and transformers load.
  MoE layers are not tensor-parallel here: the engine trains them with TP = PP = 1.
* Vocabulary padding. Megatron's vocab-parallel embedding and output layer need a row count
  divisible by the tensor-parallel size; rows past the HF vocabulary are zeros and their
  logits are masked by the model wrapper. Export drops them.
* Tensor parallelism. Column-parallel tensors (qkv, embeddings, output) split along rows,
  row-parallel ones (`linear_proj`, `linear_fc2`) along columns, `linear_fc1` splits gate
  and up separately (each rank holds `[gate_r; up_r]`), norms are replicated.

Every conversion is a reshape, slice or concatenation: HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from roles.training.moe import checkpoint_items

SUPPORTED = ("qwen2", "llama", "qwen3_moe")
LAYER_SUFFIXES = (
    "input_layernorm.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight",
    "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
QK_NORM_SUFFIXES = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
ROUTER_SUFFIX = "mlp.router.weight"
_LAYER_PREFIX = re.compile(r"^decoder\.layers\.\d+\.")
_EXPERT_PREFIX = re.compile(r"^mlp\.experts\.local_experts\.\d+\.")
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class ModelDims:
    """The architecture numbers both layouts need, read from an HF config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    rope_theta: float
    norm_eps: float
    max_positions: int
    experts: int = 0  # routed experts a layer (0: dense)
    top_k: int = 0  # experts a token
    moe_ffn: int = 0  # an expert's intermediate width
    qk_norm: bool = False  # RMSNorm over each query / key head (Qwen3)
    norm_topk: bool = True  # gate weights renormalised over the top k (HF's norm_topk_prob)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelDims:
        """Raises ValueError, naming the field, for an architecture this converter does not map."""
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED:
            raise ValueError(
                f"model.path: model_type {model_type!r} is not supported by trainer.backend=megatron "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        rope = _rope_parameters(config)
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"model.path: rope scaling {rope} is not supported by trainer.backend=megatron")
        if model_type == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
            raise ValueError("model.path: Llama attention_bias/mlp_bias are not supported by trainer.backend=megatron")
        heads = config.num_attention_heads
        moe = _moe_fields(config) if model_type == "qwen3_moe" else {}
        return cls(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            rope_theta=_rope_theta(config),
            norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
            **moe,
        )

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp

    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def layer_suffixes(self) -> tuple[str, ...]:
        dense = tuple(s for s in LAYER_SUFFIXES if self.qkv_bias or not s.endswith("linear_qkv.bias"))
        if not self.experts:
            return dense
        attention = tuple(s for s in dense if not s.startswith("mlp."))
        experts = (f"{expert_prefix(e)}linear_fc{i}.weight" for e in range(self.experts) for i in (1, 2))
        return (*attention, *(QK_NORM_SUFFIXES if self.qk_norm else ()), ROUTER_SUFFIX, *experts)

    def full_shape(self, name: str, tp: int) -> tuple[int, ...]:
        """The unsharded shape of a Megatron name (`decoder.layers.<j>.` + suffix, or top-level)."""
        suffix = _LAYER_PREFIX.sub("", name)
        h = self.hidden
        if _EXPERT_PREFIX.match(suffix):
            expert = {"linear_fc1.weight": (2 * self.moe_ffn, h), "linear_fc2.weight": (h, self.moe_ffn)}
            return expert[_EXPERT_PREFIX.sub("", suffix)]
        shapes = {
            ROUTER_SUFFIX: (self.experts, h),
            QK_NORM_SUFFIXES[0]: (self.head_dim,),
            QK_NORM_SUFFIXES[1]: (self.head_dim,),
            "input_layernorm.weight": (h,),
            "pre_mlp_layernorm.weight": (h,),
            "self_attention.linear_qkv.weight": (self.qkv_rows(), h),
            "self_attention.linear_qkv.bias": (self.qkv_rows(),),
            "self_attention.linear_proj.weight": (h, self.heads * self.head_dim),
            "mlp.linear_fc1.weight": (2 * self.ffn, h),
            "mlp.linear_fc2.weight": (h, self.ffn),
            "decoder.final_layernorm.weight": (h,),
            "embedding.word_embeddings.weight": (self.padded_vocab(tp), h),
            "output_layer.weight": (self.padded_vocab(tp), h),
        }
        return shapes[suffix]


def expert_prefix(e: int) -> str:
    """The layer suffix prefix of expert `e`'s weights in megatron-core's SequentialMLP."""
    return f"mlp.experts.local_experts.{e}."


def _moe_fields(config: Any) -> dict[str, Any]:
    """A Qwen3-MoE config's expert numbers; ValueError naming a field that makes some layer
    dense (megatron's layer spec here is MoE in every layer) or adds attention biases."""
    if getattr(config, "attention_bias", False):
        raise ValueError("model.path: Qwen3-MoE attention_bias is not supported by trainer.backend=megatron")
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            "model.path: Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step != 1) is not "
            "supported by trainer.backend=megatron"
        )
    return dict(
        experts=int(config.num_experts),
        top_k=int(config.num_experts_per_tok),
        moe_ffn=int(config.moe_intermediate_size),
        qk_norm=True,
        norm_topk=bool(config.norm_topk_prob),
    )


def _rope_parameters(config: Any) -> dict[str, Any]:
    """transformers >= 5 keeps theta and scaling in `rope_parameters` (aliased `rope_scaling`)."""
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    return float(theta if theta is not None else _rope_parameters(config).get("rope_theta", 10000.0))


def stage_layers(dims: ModelDims, stage: int, pp: int) -> range:
    """Global indices of the layers pipeline stage `stage` of `pp` holds."""
    if dims.layers % pp:
        raise ValueError(f"trainer.megatron.pipeline_model_parallel_size={pp} must divide the {dims.layers} layers")
    per = dims.layers // pp
    return range(stage * per, (stage + 1) * per)


# --- fusions -------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: ModelDims) -> torch.Tensor:
    rest = q.shape[1:]
    per_group = dims.heads // dims.kv_heads * dims.head_dim
    groups = (
        q.reshape(dims.kv_heads, per_group, *rest),
        k.reshape(dims.kv_heads, dims.head_dim, *rest),
        v.reshape(dims.kv_heads, dims.head_dim, *rest),
    )
    return torch.cat(groups, dim=1).reshape(dims.qkv_rows(), *rest)


def split_qkv(qkv: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    per_group = dims.heads // dims.kv_heads * dims.head_dim
    grouped = qkv.reshape(dims.kv_heads, per_group + 2 * dims.head_dim, *rest)
    q, k, v = grouped.split([per_group, dims.head_dim, dims.head_dim], dim=1)
    return (
        q.reshape(dims.heads * dims.head_dim, *rest),
        k.reshape(dims.kv_heads * dims.head_dim, *rest),
        v.reshape(dims.kv_heads * dims.head_dim, *rest),
    )


def pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


# --- whole-model conversion (full, unsharded tensors) ---------------------------------------
def hf_to_megatron(
    get: Callable[[str], torch.Tensor], dims: ModelDims, *, stage: int = 0, pp: int = 1, tp: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name, full tensor) for every parameter of pipeline stage `stage`.

    `get(hf_name)` returns an HF tensor; it is asked only for what this stage holds.
    """
    rows = dims.padded_vocab(tp)
    if stage == 0:
        yield "embedding.word_embeddings.weight", pad_vocab(get("model.embed_tokens.weight"), rows)
    for j, i in enumerate(stage_layers(dims, stage, pp)):
        hf = f"model.layers.{i}."
        mg = f"decoder.layers.{j}."
        attn = hf + "self_attn."
        yield mg + "input_layernorm.weight", get(hf + "input_layernorm.weight")
        qkv = fuse_qkv(get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), dims)
        yield mg + "self_attention.linear_qkv.weight", qkv
        if dims.qkv_bias:
            bias = fuse_qkv(get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), dims)
            yield mg + "self_attention.linear_qkv.bias", bias
        yield mg + "self_attention.linear_proj.weight", get(attn + "o_proj.weight")
        if dims.qk_norm:
            yield mg + QK_NORM_SUFFIXES[0], get(attn + "q_norm.weight")
            yield mg + QK_NORM_SUFFIXES[1], get(attn + "k_norm.weight")
        yield mg + "pre_mlp_layernorm.weight", get(hf + "post_attention_layernorm.weight")
        if dims.experts:
            yield from _experts_to_megatron(get, dims, hf, mg)
            continue
        fc1 = torch.cat([get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")])
        yield mg + "mlp.linear_fc1.weight", fc1
        yield mg + "mlp.linear_fc2.weight", get(hf + "mlp.down_proj.weight")
    if stage == pp - 1:
        yield "decoder.final_layernorm.weight", get("model.norm.weight")
        # Tied: the last stage keeps its own copy of the embeddings as the output layer
        # (pp > 1); with pp == 1 megatron has no output_layer parameter.
        if not dims.tied:
            yield "output_layer.weight", pad_vocab(get("lm_head.weight"), rows)
        elif pp > 1:
            yield "output_layer.weight", pad_vocab(get("model.embed_tokens.weight"), rows)


def _experts_to_megatron(
    get: Callable[[str], torch.Tensor], dims: ModelDims, hf: str, mg: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The router and every expert of one MoE layer (`hf`, `mg`: its name prefixes)."""
    yield mg + ROUTER_SUFFIX, get(hf + "mlp.gate.weight")
    for e in range(dims.experts):
        src = f"{hf}mlp.experts.{e}."
        fc1 = torch.cat([get(src + "gate_proj.weight"), get(src + "up_proj.weight")])
        yield mg + expert_prefix(e) + "linear_fc1.weight", fc1
        yield mg + expert_prefix(e) + "linear_fc2.weight", get(src + "down_proj.weight")


def _experts_to_hf(layer: dict[str, torch.Tensor], dims: ModelDims, hf: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One MoE layer's router and experts by HF checkpoint name: the experts stacked into the
    fused tensors transformers holds (`linear_fc1` is `[gate; up]`, as a row of `gate_up_proj`),
    then split per expert as checkpoints name them."""
    yield hf + "mlp.gate.weight", layer[ROUTER_SUFFIX]
    gate_up = torch.stack([layer[expert_prefix(e) + "linear_fc1.weight"] for e in range(dims.experts)])
    down = torch.stack([layer[expert_prefix(e) + "linear_fc2.weight"] for e in range(dims.experts)])
    yield from checkpoint_items(hf + "mlp.experts.gate_up_proj", gate_up)
    yield from checkpoint_items(hf + "mlp.experts.down_proj", down)


def megatron_layer_to_hf(layer: dict[str, torch.Tensor], i: int, dims: ModelDims) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of global layer `i` from its full Megatron tensors keyed by layer suffix."""
    hf = f"model.layers.{i}."
    attn = hf + "self_attn."
    yield hf + "input_layernorm.weight", layer["input_layernorm.weight"]
    q, k, v = split_qkv(layer["self_attention.linear_qkv.weight"], dims)
    yield from ((attn + "q_proj.weight", q), (attn + "k_proj.weight", k), (attn + "v_proj.weight", v))
    if dims.qkv_bias:
        q, k, v = split_qkv(layer["self_attention.linear_qkv.bias"], dims)
        yield from ((attn + "q_proj.bias", q), (attn + "k_proj.bias", k), (attn + "v_proj.bias", v))
    yield attn + "o_proj.weight", layer["self_attention.linear_proj.weight"]
    if dims.qk_norm:
        yield attn + "q_norm.weight", layer[QK_NORM_SUFFIXES[0]]
        yield attn + "k_norm.weight", layer[QK_NORM_SUFFIXES[1]]
    yield hf + "post_attention_layernorm.weight", layer["pre_mlp_layernorm.weight"]
    if dims.experts:
        yield from _experts_to_hf(layer, dims, hf)
        return
    gate, up = layer["mlp.linear_fc1.weight"].chunk(2)
    yield hf + "mlp.gate_proj.weight", gate
    yield hf + "mlp.up_proj.weight", up
    yield hf + "mlp.down_proj.weight", layer["mlp.linear_fc2.weight"]


def megatron_top_to_hf(name: str, tensor: torch.Tensor, dims: ModelDims) -> tuple[str, torch.Tensor]:
    """HF (name, tensor) of a top-level Megatron tensor (embeddings, final norm, output layer)."""
    hf = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }[name]
    return hf, tensor[: dims.vocab] if name != "decoder.final_layernorm.weight" else tensor


# --- tensor parallelism ---------------------------------------------------------------------
def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slice of the full Megatron tensor `name` (a view where possible)."""
    if size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    if name.endswith(_ROW_PARALLEL):
        return full.chunk(size, dim=1)[rank]
    if name.endswith(_COLUMN_PARALLEL):
        return full.chunk(size, dim=0)[rank]
    return full


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (inverse of `tp_shard`)."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([*(h[0] for h in halves), *(h[1] for h in halves)])
    if name.endswith(_ROW_PARALLEL):
        return torch.cat(shards, dim=1)
    if name.endswith(_COLUMN_PARALLEL):
        return torch.cat(shards, dim=0)
    return shards[0]


def is_tp_sharded(name: str) -> bool:
    return name.endswith(("linear_fc1.weight", *_ROW_PARALLEL, *_COLUMN_PARALLEL))


def check_divisible(dims: ModelDims, tp: int, field: str) -> None:
    """ValueError naming `field`.tensor_model_parallel_size unless TP divides the heads,
    KV heads and FFN width of the model (a mixture of experts: unless TP is 1)."""
    if dims.experts and tp > 1:
        raise ValueError(f"{field}.tensor_model_parallel_size={tp}: a mixture-of-experts policy trains with TP=1")
    if dims.heads % tp or dims.kv_heads % tp:
        raise ValueError(
            f"{field}.tensor_model_parallel_size={tp} must divide the model's {dims.heads} attention "
            f"heads and {dims.kv_heads} KV heads"
        )
    if dims.ffn % tp:
        raise ValueError(f"{field}.tensor_model_parallel_size={tp} must divide intermediate_size {dims.ffn}")
