"""What a run with `trainer.lora` means for its roles' settings (no torch, no vLLM here).

* `adapter_config(lora)`: the `adapter_config.json` fields PEFT and vLLM read;
* `engine_lora_rank(cfg)`: vLLM's `max_lora_rank` (fixed when the engine starts): the
  smallest size vLLM offers that holds `trainer.lora.rank`, unless
  `rollout.engine.max_lora_rank` is set; 0 without LoRA;
* `engine_max_loras(cfg)`: adapters vLLM holds at once, one per policy version a request
  in flight may still use (`rollout.max_staleness + 2`), unless `rollout.engine.max_loras`
  is set.
"""

from __future__ import annotations

from typing import Any

from runtime.config import LoraConfig, RunConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` choices


def adapter_config(lora: LoraConfig) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }


def engine_lora_rank(cfg: RunConfig) -> int:
    rank = cfg.trainer.lora.rank
    if rank == 0:
        return 0
    if cfg.rollout.engine.max_lora_rank:
        return cfg.rollout.engine.max_lora_rank
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def engine_max_loras(cfg: RunConfig) -> int:
    return cfg.rollout.engine.max_loras or cfg.rollout.max_staleness + 2
