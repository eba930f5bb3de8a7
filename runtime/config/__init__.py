"""The run configuration: typed msgspec Structs, loaded from YAML plus dotted overrides.

Importing this module needs neither torch nor vLLM. Every field has a default and a
description (`Annotated[..., Meta(description=...)]`); `docs/config.md` is generated
from them (`tandem config-docs`). `load_config` fails before anything starts, with a
one-line `ConfigError` naming the key and, where there are any, the valid choices.

This package is the bottom floor of `runtime`: it imports nothing of `runtime` but
`runtime.errors`, and asks nothing of the machine. The checks of the machine and the
environment (GPUs, packages, user functions, files) are `runtime.preflight`'s, and `auto`
keys are settled for this machine by `runtime.memory.auto.load_settled`, which the `tandem`
command loads a recipe with.

One module per section, each importable alone; this package re-exports every struct, so
`from runtime.config import RunConfig` is the way in:

  base.py           `Doc` and the Struct options every section shares
  model.py          the policy model
  data.py           the prompt dataset
  rollout.py        generation
  trainer.py        the actor trainer
  critic.py         the value model
  algorithm.py      advantages and KL
  distill.py        on-policy distillation from a teacher role
  reward.py         reward functions, the reward model and the judge
  run.py            the run's remaining sections (weight sync, checkpoints, placement, transport,
                    metrics, memory, validation) and `RunConfig`, which holds them all
  placement.py      where the config places the run's processes (entries, ranks, GPUs named)
  gpu_share.py      the checks of the GPUs that placed processes share (memory fractions, weight sync)
  lora_settings.py  what `trainer.lora` means for the roles' settings (adapter config, vLLM's rank)
  load.py           YAML + `base:` layers + dotted overrides -> a `RunConfig` (`load_config`)
  validate.py       the checks across sections (`check_config`), which `tandem launch` runs first
"""

from __future__ import annotations

from runtime.config.algorithm import AlgorithmConfig, OverlongConfig
from runtime.config.base import STRUCT, Doc
from runtime.config.critic import CriticConfig
from runtime.config.data import DataConfig, ReasoningGymConfig, VerifiersConfig
from runtime.config.model import ModelConfig, TinyModelConfig
from runtime.config.reward import DEFAULT_JUDGE_TEMPLATE, JudgeConfig, RewardConfig, RewardModelConfig
from runtime.config.rollout import EngineConfig, LengthDistConfig, OpenAIEndpointConfig, RolloutConfig
from runtime.config.run import (
    CheckpointConfig,
    MemoryConfig,
    MetricsConfig,
    PlacementEntry,
    RunConfig,
    TransportConfig,
    ValidationConfig,
    WeightSyncConfig,
)
from runtime.config.trainer import (
    LORA_TARGETS,
    BackwardPrefetch,
    FSDPConfig,
    KLConfig,
    LoraConfig,
    LossConfig,
    MegatronConfig,
    MixedPrecisionConfig,
    OffloadConfig,
    OptimConfig,
    RolloutCorrectionConfig,
    ShardingStrategy,
    TrainerConfig,
)

__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "LORA_TARGETS",
    "STRUCT",
    "AlgorithmConfig",
    "BackwardPrefetch",
    "CheckpointConfig",
    "CriticConfig",
    "DataConfig",
    "Doc",
    "EngineConfig",
    "FSDPConfig",
    "JudgeConfig",
    "KLConfig",
    "LengthDistConfig",
    "LoraConfig",
    "LossConfig",
    "MegatronConfig",
    "MemoryConfig",
    "MetricsConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "OffloadConfig",
    "OpenAIEndpointConfig",
    "OptimConfig",
    "OverlongConfig",
    "PlacementEntry",
    "ReasoningGymConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "ShardingStrategy",
    "TinyModelConfig",
    "TrainerConfig",
    "TransportConfig",
    "ValidationConfig",
    "VerifiersConfig",
    "WeightSyncConfig",
]
