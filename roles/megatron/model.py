"""A megatron-core `GPTModel` built from an HF model directory, and the wrappers the
Megatron engines train: `MegatronActor` (the policy, built in or brought by the user) and
`MegatronValueModel` (the critic: the same trunk, a scalar `ValueHead` as output layer).

Needs megatron-core's parallel state initialised (`parallel_state.initialize_model_parallel`)
before a model is built or loaded. `load_hf_weights` and `export_hf_weights` are
collectives over the tensor- and pipeline-parallel groups of the caller's model replica.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from roles.megatron.convert import (
    ModelDims,
    hf_to_megatron,
    is_tp_sharded,
    megatron_layer_to_hf,
    megatron_top_to_hf,
    stage_layers,
    tp_shard,
    tp_unshard,
)

# Logits of the padding rows of a TP-padded vocabulary: exp() of it is 0 and 0 * it is 0.
_MASKED_LOGIT = -1.0e30


def causal_inputs(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTModel's position ids `[B, T]` and causal mask `[1, 1, T, T]` (True = masked) for
    right-padded rows."""
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, -1)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=input_ids.device), 1).view(1, 1, T, T)
    return positions, causal


class GPTStage(nn.Module):
    """One pipeline stage of a megatron-core `GPTModel` behind the engines' plain forward.

    `forward(input_ids, attention_mask=None)` runs the stage on right-padded `[B, T]` ids
    with positions `0..T-1` and causal attention (`attention_mask` is accepted for
    interface compatibility: causal attention over right padding needs no padding mask)
    and returns `outputs(out, last)`: a subclass names what the last stage's output means.
    The stage is `module` (its state-dict prefix) and its `config` megatron's schedule reads.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model
        self.config = model.config

    def set_input_tensor(self, tensor: Any) -> None:
        self.module.set_input_tensor(tensor)  # type: ignore[operator]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        del attention_mask
        out = self.module(input_ids, *causal_inputs(input_ids))
        return self.outputs(out, last=getattr(self.module, "post_process", True))

    def outputs(self, out: torch.Tensor, *, last: bool) -> dict[str, Any]:
        """What `forward` returns for the stage's output `out` (`last`: the last stage's)."""
        raise NotImplementedError


class MegatronActor(GPTStage):
    """A megatron-core `GPTModel` (one pipeline stage of it) behind a plain interface.

    `forward(input_ids, attention_mask=None)` takes right-padded `[B, T]` token ids and
    returns `{"logits": ..., "values": None}`. On the last pipeline stage `logits` are this
    tensor-parallel rank's vocabulary slice, `[B, T, padded_vocab / tp]` in float32, with
    the padding rows past `vocab_size` masked to -1e30; on other stages they are the
    stage's output hidden states (what the pipeline schedule sends on). Positions are
    `0..T-1` and attention is causal, so padded positions never affect real ones; their
    outputs are meaningless. `attention_mask` is accepted for interface compatibility.

    Bring your own model: build a `GPTModel` for this rank's stage and pass it here from
    the function named by `trainer.megatron.model_provider`.
    """

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        super().__init__(model)
        self.vocab_size = vocab_size

    def outputs(self, out: torch.Tensor, *, last: bool) -> dict[str, Any]:
        return {"logits": self._mask_padded_vocab(out.float()) if last else out, "values": None}

    def _mask_padded_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        local = logits.shape[-1]
        start = ps.get_tensor_model_parallel_rank() * local
        if start + local <= self.vocab_size:
            return logits
        keep = torch.arange(start, start + local, device=logits.device) < self.vocab_size
        return logits.masked_fill(~keep, _MASKED_LOGIT)


def transformer_config(dims: ModelDims, *, tp: int, pp: int, dtype: torch.dtype, recompute: bool) -> Any:
    """The `TransformerConfig` of an HF Qwen2 / Llama / Qwen3-MoE architecture (local spec, no fusions)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Pipeline micro-batches carry their own shapes; megatron refuses that beside its
    # default MoE dispatcher, so a dense model names the one that allows it.
    extra: dict[str, Any] = {"moe_token_dispatcher_type": "alltoall"}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if dims.experts:
        extra.update(moe_config(dims))
    return TransformerConfig(
        num_layers=dims.layers,
        hidden_size=dims.hidden,
        num_attention_heads=dims.heads,
        num_query_groups=dims.kv_heads,
        ffn_hidden_size=dims.ffn,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        # Initialising is wasted on weights loaded next, but it is also what marks a param as
        # tensor-parallel; unmarked, TP rank > 0's shards drop out of the gradient norm.
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=pp > 1,
        **extra,
    )


def moe_config(dims: ModelDims) -> dict[str, Any]:
    """The `TransformerConfig` fields of a mixture of experts: every layer MoE, SequentialMLP
    experts (no grouped GEMM: it needs TransformerEngine or the grouped_gemm package), expert
    parallel size 1 with the all-gather dispatcher (the all-to-all one makes CUDA streams when
    built), q/k norms. Routing is `roles/megatron/moe.py`'s (HF's softmax top-k, its
    load-balancing loss added by the engine), so megatron's own balancing is off."""
    return dict(
        num_moe_experts=dims.experts,
        moe_router_topk=dims.top_k,
        moe_ffn_hidden_size=dims.moe_ffn,
        moe_router_pre_softmax=not dims.norm_topk,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        qk_layernorm=dims.qk_norm,
    )


def layer_spec(dims: ModelDims) -> Any:
    """TransformerEngine's layer spec when it imports, else megatron-core's local one."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    moe: dict[str, Any] = dict(num_experts=dims.experts or None, moe_grouped_gemm=False, qk_layernorm=dims.qk_norm)
    try:
        import transformer_engine  # noqa: F401

        return specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    except ImportError:
        return specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe)


def build_actor(dims: ModelDims, config: Any, device: torch.device) -> MegatronActor:
    """This rank's pipeline stage of the GPTModel for `dims`, on `device`, uninitialised."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    vocab = dims.padded_vocab(config.tensor_model_parallel_size)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(dims),
        vocab_size=vocab,
        max_sequence_length=dims.max_positions,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=dims.tied,
        position_embedding_type="rope",
        rotary_base=int(dims.rope_theta),
    )
    return MegatronActor(model.to(device), dims.vocab)


# TransformerEngine's spec fuses the norms into the next linear layer; the local spec's names are canonical.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def make_actor(provider: str, hf_config: Any, config: Any, dims: ModelDims, device: torch.device) -> MegatronActor:
    """This rank's stage: built in (`provider` empty) or from `module:function`, which is
    called as `function(hf_config, transformer_config)` and returns a GPTModel for this
    rank's pipeline stage (read `parallel_state`) or a MegatronActor. Either way the HF
    weights of `model.path` are loaded into it next, so its parameter names must be
    megatron-core's GPTModel names (local or TransformerEngine spec)."""
    if not provider:
        return build_actor(dims, config, device)
    module, _, name = provider.partition(":")
    model = getattr(importlib.import_module(module), name)(hf_config, config)
    actor = model if isinstance(model, MegatronActor) else MegatronActor(model, dims.vocab)
    return actor.to(device)


class ValueHead(nn.Module):
    """A scalar per position in place of GPTModel's output layer: called as the output layer
    is (`(hidden [S, B, H], weight=None, ...)` -> `(values [S, B, 1], None)`), starts at zero.
    Replicated over tensor-parallel ranks (their hidden states are equal)."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.score = nn.Linear(hidden, 1, bias=False, dtype=dtype, device=device)
        nn.init.zeros_(self.score.weight)

    def forward(self, hidden: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        return self.score(hidden), None


class MegatronValueModel(GPTStage):
    """A GPTModel stage whose output layer is a `ValueHead`: `forward(input_ids)` takes
    right-padded `[B, T]` ids and returns `{"values": [B, T] float32}` on the last stage
    (the head's output at each position; padded positions are meaningless), the stage's
    hidden states elsewhere (under "values", what the pipeline schedule sends on)."""

    def outputs(self, out: torch.Tensor, *, last: bool) -> dict[str, Any]:
        return {"values": out[..., 0].float() if last else out}


def build_value_model(dims: ModelDims, config: Any, device: torch.device) -> MegatronValueModel:
    """This rank's stage of the critic: the GPTModel for `dims` (untied), its output layer
    replaced by a zero `ValueHead` (Megatron name `output_layer.score.weight`); load the
    policy's HF weights with `skip=VALUE_HEAD`."""
    import dataclasses

    untied = dataclasses.replace(dims, tied=False)
    model = build_actor(untied, config, device).module
    if getattr(model, "post_process", True):
        model.output_layer = ValueHead(dims.hidden, config.params_dtype, device)
    return MegatronValueModel(model)


VALUE_HEAD = ("output_layer.",)


def parameters_by_name(actor: nn.Module) -> dict[str, torch.Tensor]:
    """The GPTModel's tensors by local-spec Megatron name (wrappers and extra state left out)."""
    out = {}
    for name, t in unwrap(actor).state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or t is None:
            continue
        for te, local in _TE_NAMES.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
        out[name] = t
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module: through DDP's and MegatronActor's `.module`."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


@torch.no_grad()
def load_hf_weights(actor: nn.Module, model_dir: Path, dims: ModelDims, *, skip: tuple[str, ...] = ()) -> None:
    """Copy the HF safetensors of `model_dir` into this rank's shard of the model.
    Megatron names starting with a `skip` prefix are neither loaded nor required (a
    critic's value head, which HF has no weights for).

    Raises ValueError when a Megatron parameter is left without an HF tensor or the
    shapes disagree (names both sides)."""
    from megatron.core import parallel_state as ps
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.path: no *.safetensors in {model_dir}")
    handles = [safe_open(str(f), framework="pt") for f in files]
    index = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (safe_open has no __iter__)

    def get(name: str) -> torch.Tensor:
        if name not in index:
            raise ValueError(f"model.path: {model_dir} has no tensor {name!r}")
        return index[name].get_tensor(name)

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    stage, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    params = {k: v for k, v in parameters_by_name(actor).items() if not k.startswith(skip or ("\0",))}
    loaded = set()
    for name, full in hf_to_megatron(get, dims, stage=stage, pp=pp, tp=tp):
        if skip and name.startswith(skip):
            continue
        if name not in params:
            raise ValueError(f"megatron model has no parameter {name!r} (from the HF weights)")
        shard = tp_shard(name, full, tp_rank, tp)
        if tuple(shard.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{name}: HF gives {tuple(shard.shape)}, the megatron model has {tuple(params[name].shape)}"
            )
        params[name].copy_(shard)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"megatron parameters not in the HF weights: {missing[:5]}")


@torch.no_grad()
def export_hf_weights(actor: nn.Module, dims: ModelDims, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor in `dtype`, in HF order: embeddings, layers, final norm, lm_head.

    A collective over this replica's TP and PP groups: every rank must iterate it to the
    end. The first pipeline stage's ranks get every tensor (gathered over TP, sent on from
    the stage that owns it); other ranks get the tensors of their own stage.
    """
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    params = parameters_by_name(actor)
    device = next(iter(params.values())).device

    def full(name: str, owner: int) -> torch.Tensor | None:
        """The unsharded tensor `name` of stage `owner`, on stage 0 and on the owner."""
        t = None
        if stage == owner:
            t = _gather_tp(name, params[name].detach().to(dtype), tp)
        if pp == 1 or owner == 0:
            return t
        if stage not in (0, owner):
            return None
        buf = t.contiguous() if t is not None else torch.empty(dims.full_shape(name, tp), dtype=dtype, device=device)
        group = ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        if stage == owner:
            dist.send(buf, dst=ranks[0], group=group)
        else:
            dist.recv(buf, src=ranks[owner], group=group)
        return buf

    emb = full("embedding.word_embeddings.weight", 0)
    if emb is not None:
        yield megatron_top_to_hf("embedding.word_embeddings.weight", emb.cpu(), dims)
    for s in range(pp):
        for j, i in enumerate(stage_layers(dims, s, pp)):
            layer = {}
            for suffix in dims.layer_suffixes():
                t = full(f"decoder.layers.{j}.{suffix}", s)
                if t is not None:
                    layer[suffix] = t.cpu()
            if len(layer) == len(dims.layer_suffixes()):
                yield from megatron_layer_to_hf(layer, i, dims)
    last = pp - 1
    for name in ("decoder.final_layernorm.weight", *(() if dims.tied else ("output_layer.weight",))):
        t = full(name, last)
        if t is not None:
            yield megatron_top_to_hf(name, t.cpu(), dims)


def _gather_tp(name: str, local: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1 or not is_tp_sharded(name):
        return local
    from megatron.core import parallel_state as ps

    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local, group=ps.get_tensor_model_parallel_group())
    return tp_unshard(name, shards)


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) from `[B, T, vocab / tp]` logits: `[B, T-1]`, float32."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron's cross entropy writes into its input: hand it a copy.
    return -vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), ids[:, 1:].contiguous())


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the full vocabulary from this TP rank's slice (no gradient)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    logits = logits.float()
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
    dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]
