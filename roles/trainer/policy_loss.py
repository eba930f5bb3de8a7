"""The policy-loss options of a run, as `ppo_policy_loss` keyword arguments.

Both actor engines (FSDP and Megatron) call `ppo_policy_loss` with `policy_loss_options(cfg)`,
so a `trainer.loss` key means the same in either.
"""

from __future__ import annotations

from typing import Any

from roles.algo.rollout_correction import ISCorrection
from runtime.config import RunConfig


def policy_loss_options(cfg: RunConfig) -> dict[str, Any]:
    """Everything of `ppo_policy_loss` but the tensors and the step's global counts."""
    lc = cfg.trainer.loss
    rc = lc.rollout_correction
    correction = ISCorrection(mode=rc.mode, level=rc.level, cap=lc.importance_cap, low=rc.mask_low, high=rc.mask_high)
    return dict(
        clip_low=lc.clip_low,
        clip_high=lc.clip_high,
        importance_cap=lc.importance_cap,
        mode=lc.mode,
        clip_ratio_c=lc.clip_ratio_c,
        correction=correction,
        agg=lc.agg,
        norm_tokens=float(lc.norm_tokens or cfg.rollout.max_tokens),
    )
