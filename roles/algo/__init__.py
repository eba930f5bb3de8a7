"""RL math as pure torch functions: advantages, GAE, KL estimators and PPO-style losses.

Invariant: nothing here touches processes, devices or configs; every function takes and
returns tensors (or python floats for metrics) and never modifies its inputs.

Modules:
* `advantages`: advantages from rewards, one entry point for every `algorithm.advantage` value.
* `distill`: on-policy distillation's per-token advantage from a teacher's log-probabilities.
* `gae`: token-level generalised advantage estimation and masked whitening.
* `kl`: per-token KL(pi || ref) estimators and KL-coefficient controllers.
* `losses`: token-level losses: decoupled PPO policy losses, value loss, entropy.
* `masked`: masked reductions over padded [B, T] batches.
* `rollout_correction`: importance weights that correct for the behaviour policy (vLLM).
* `shaping`: reward shaping from response lengths.
"""

from roles.algo.advantages import (
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from roles.algo.gae import gae_advantages, whiten
from roles.algo.kl import AdaptiveKLController, FixedKLController, kl_controller, kl_penalty
from roles.algo.losses import (
    entropy_from_logits,
    explained_variance,
    ppo_policy_loss,
    token_logprobs,
    value_loss,
)
from roles.algo.masked import aggregate, masked_mean, masked_sum

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "broadcast_to_tokens",
    "compute_advantages",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "grpo_advantages",
    "kl_controller",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "token_logprobs",
    "value_loss",
    "whiten",
]
