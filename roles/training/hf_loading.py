"""Loading HF models for the engines, and the dtype names configs use.

`load_causal_lm` gives the same module on every rank for the same directory (weights
come from the files, not from a random initialisation), as FSDP2 wrapping requires.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_causal_lm(
    model_path: Path,
    dtype: torch.dtype,
    device: torch.device,
    *,
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """The HF causal LM in `model_path`, in `dtype` with `attn_implementation` (SDPA by default;
    a registered name such as roles/kernels/varlen.py's), on `device`;
    `gradient_checkpointing` recomputes each block's activations in backward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation=attn_implementation)
    module: torch.nn.Module = model  # transformers' own `to` wrapper hides torch's signature
    module.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return module
