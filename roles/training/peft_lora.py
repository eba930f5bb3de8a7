"""LoRA on the trainer's HF model, through PEFT (`trainer.lora.rank > 0`).

`apply_lora(model, lora)` wraps the loaded model (before FSDP) so that only the adapter
parameters train: the base is frozen, so the optimizer, the gradient clip and the
checkpoints see only the adapters. PEFT starts each adapter's B at zero, so version 0 of
the policy is the base model exactly. With the adapter disabled
(`model.disable_adapter()`) the model is the frozen base: the reference policy of
`algorithm.kl.use: loss`, with no second copy of the weights.

`store_frozen_in(model, dtype)` keeps the frozen base in the compute dtype of FSDP2's mixed
precision (`fsdp.mixed_precision.param_dtype`) instead of the float32 master dtype: FSDP2
casts every parameter to that dtype before each forward anyway, so the base computes the
same values, and it holds half the memory (a 7.62B base: 15.2 GB instead of 30.5). Only the
adapters keep float32 masters, which the optimizer updates.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.config import LoraConfig


def apply_lora(model: nn.Module, lora: LoraConfig, *, gradient_checkpointing: bool = False) -> nn.Module:
    """The PEFT model around `model` (its weights untouched), only adapters trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    missing = [t for t in lora.target_modules if not any(n.split(".")[-1] == t for n, _ in model.named_modules())]
    if missing:
        raise ValueError(f"trainer.lora.target_modules: no module of the model is named {missing}")
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)  # type: ignore[arg-type]
    if gradient_checkpointing:
        # Checkpointed blocks must see an input that requires grad, or the frozen
        # embeddings leave the adapters inside them without gradients.
        peft_model.enable_input_require_grads()
    return peft_model  # type: ignore[no-any-return]


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every frozen floating-point parameter of `model` to `dtype` in place (before FSDP
    wraps it); trainable ones keep theirs."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
