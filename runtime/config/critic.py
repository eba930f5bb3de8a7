"""The value model: `critic.*`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.base import STRUCT, Doc
from runtime.config.trainer import MegatronConfig, OptimConfig


class CriticConfig(msgspec.Struct, **STRUCT):
    backend: Annotated[
        Literal["fsdp", "megatron"],
        Doc(description="Value-model engine: FSDP2 or Megatron-core (a GPTModel with a scalar head; needs CUDA)."),
    ] = "fsdp"
    megatron: Annotated[
        MegatronConfig,
        Doc(description="Megatron-core options of the critic (backend: megatron; pipeline size 1, no model_provider)."),
    ] = msgspec.field(default_factory=MegatronConfig)
    model_path: Annotated[
        str, Doc(description="Initialise the value model from this HF directory; empty = from the actor's.")
    ] = ""
    optim: Annotated[OptimConfig, Doc(description="Critic optimizer.")] = msgspec.field(
        default_factory=lambda: OptimConfig(lr=1e-4)
    )
    value_clip: Annotated[float, Doc(description="Clip of the value update around the old value; 0 = off.", ge=0)] = 0.2
    micro_batch_tokens: Annotated[int, Doc(description="Token budget of one critic micro-batch.", ge=1)] = 4096
    epochs: Annotated[int, Doc(description="Passes of the critic over each batch (PPO epochs).", ge=1)] = 1
    mini_batches: Annotated[
        int, Doc(description="Critic optimizer steps per epoch (seeded, shuffled mini-batches of the shard).", ge=1)
    ] = 1
