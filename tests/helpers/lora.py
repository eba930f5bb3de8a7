"""The check of a merged LoRA export that the engine test and the end-to-end run share."""

from __future__ import annotations

import torch

PEFT_PREFIX = "base_model.model."


def assert_merged(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], merged: dict[str, torch.Tensor], scale: float
) -> int:
    """Every tensor of `base` is in `merged`, in its dtype: base + scale * B @ A for a
    projection `adapter` (PEFT names) adapts (merged in float32, saved in the base's dtype:
    equal to its rounding) and changed by it, the base's bit for bit otherwise. Returns the
    number of adapted tensors."""
    assert set(merged) <= set(base), sorted(set(merged) - set(base))
    checked = 0
    for name, w in base.items():
        assert merged[name].dtype == w.dtype, name
        stem = name.removesuffix(".weight")
        a, b = adapter.get(f"{PEFT_PREFIX}{stem}.lora_A.weight"), adapter.get(f"{PEFT_PREFIX}{stem}.lora_B.weight")
        if a is None or b is None:
            assert torch.equal(merged[name], w), name
            continue
        want = w.float() + scale * (b.float() @ a.float())
        assert torch.allclose(merged[name].float(), want, atol=1e-6, rtol=2**-8), name
        assert not torch.equal(merged[name], w), f"{name}: the adapter was not merged"
        checked += 1
    return checked
