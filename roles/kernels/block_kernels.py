"""The FSDP actor's kernels for the non-GEMM part of a block (`trainer.kernels`).

* `torch` (the default): transformers' own RMSNorm, SwiGLU MLP and RoPE, fused by inductor
  when `trainer.compile` is on;
* `liger`: Liger Kernel's Triton kernels for RMSNorm, the SwiGLU MLP and RoPE
  (`liger_kernel.transformers._apply_liger_kernel_to_instance`, the call TRL makes), put into
  the loaded HF model before the LM head is replaced, blocks are compiled or FSDP wraps them.
  Liger's fused linear cross-entropy is not used: it computes a loss, not the per-token
  logprobs and entropy PPO needs (roles/kernels/token_stats.py does those). Liger patches
  transformers' module for the model type too (its RoPE function, its norm and MLP classes),
  so every model built later in the process (the reference policy) runs the same kernels.

What a caller may rely on: `apply_kernels(model, "torch")` changes nothing; with `"liger"`
every RMSNorm and MLP of the model is Liger's afterwards, or it raises `RuntimeError`
naming what is missing (the package, or kernels for the model's type).
"""

from __future__ import annotations

import importlib.util

import torch

KERNELS = ("torch", "liger")


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def apply_kernels(model: torch.nn.Module, kernels: str) -> None:
    if kernels == "torch":
        return
    if kernels != "liger":
        raise ValueError(f"trainer.kernels must be one of {KERNELS}, not {kernels!r}")
    if not liger_available():
        raise RuntimeError("trainer.kernels=liger needs the liger-kernel package (pip install liger-kernel)")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    untouched = [name for name, m in model.named_modules() if _is_plain(m)]
    if untouched:
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        raise RuntimeError(
            f"trainer.kernels=liger: Liger Kernel left {len(untouched)} modules of model type {model_type} "
            f"as they were (first: {untouched[0]}); it has no kernels for them: use trainer.kernels=torch"
        )


def _is_plain(module: torch.nn.Module) -> bool:
    """An RMSNorm or MLP of transformers' own that Liger did not patch (Liger binds its
    `forward` and `_get_name` into each module it patches)."""
    kind = type(module).__name__
    return kind.endswith(("RMSNorm", "MLP")) and not module._get_name().startswith("Liger")
