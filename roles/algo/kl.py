"""Per-token KL(pi || ref) estimators and KL-coefficient controllers.

Invariant: for tokens sampled from pi, the expectation of "k1" is exactly KL(pi || ref),
and of "k3" too up to its clamp (a token's k3 is at most 10, as in verl: an unclamped far
token gives up to e^20); "k3" is never negative and "low_var_kl" is its verl name; "k2"
is a biased, low-variance estimate (0.5 * E[log_ratio**2]) that matches KL to second
order when pi is close to ref.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
_K3_LOG_RATIO_BOUND = 20.0
_K3_MAX = 10.0


def kl_penalty(logp_BT: Tensor, ref_logp_BT: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from log_ratio = logp - ref_logp.

    k1 = log_ratio; k2 = 0.5 * log_ratio**2; k3 = exp(-log_ratio) - 1 + log_ratio
    (Schulman, "Approximating KL divergence"), with log_ratio clamped to [-20, 20] in k3
    and the result to at most 10 (verl's `kl_penalty`, "low_var_kl" being its name for k3).
    """
    log_ratio_BT = logp_BT - ref_logp_BT
    if estimator == "k1":
        return log_ratio_BT
    if estimator == "k2":
        return 0.5 * log_ratio_BT**2
    if estimator in ("k3", "low_var_kl"):
        log_ratio_BT = log_ratio_BT.clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
        # expm1 keeps precision when the ratio is close to 1, where k3 is tiny.
        return (torch.expm1(-log_ratio_BT) + log_ratio_BT).clamp(max=_K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


class FixedKLController:
    """A KL coefficient that never changes; `update` is a no-op."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Ignore the observation; `value` stays at `coef`."""


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 (as in verl) steering KL to `target`.

    After `update`, `value` has grown when `current_kl > target` and shrunk when below,
    by a factor of at most 1 +/- 0.2 * n_steps / horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale `value` by 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def kl_controller(
    coef: float, *, adaptive: bool, target: float, horizon: float
) -> FixedKLController | AdaptiveKLController:
    """The adaptive controller when `adaptive`, else a fixed coefficient."""
    return AdaptiveKLController(coef, target, horizon) if adaptive else FixedKLController(coef)
