"""LoRA adapters on the weight path (`trainer.lora.rank > 0`).

An update then carries only the adapter tensors, named as PEFT saves them
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: the trainer's parameter
name without PEFT's adapter name), which is also what vLLM parses. `write_adapter_dir`
makes the PEFT adapter directory (`adapter_model.safetensors` + `adapter_config.json`)
that PEFT's `PeftModel.from_pretrained` and vLLM's `LoRARequest` load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ADAPTER_NAME = "default"  # PEFT's name of the one adapter the trainer trains


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight` (PEFT's saved name)."""
    return name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.").replace(f".lora_B.{ADAPTER_NAME}.", ".lora_B.")


def write_adapter_dir(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], out: Path) -> Path:
    """`out` as a PEFT adapter directory of `tensors` (PEFT names) and `config`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(dict(config), indent=2))
    return out
