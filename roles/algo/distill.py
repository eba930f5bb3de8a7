"""On-policy distillation: the per-token advantage from a teacher's log-probabilities.

As in Thinking Machines' "On-Policy Distillation" and verl's on-policy distillation, the
student samples, the teacher scores each sampled token, and the per-token reverse KL
`log pi_student(t) - log pi_teacher(t)` is the token's cost: its negative is the token's
advantage, which the chosen policy loss (ratio, clipping, importance weights) then
optimises. The student's log-probabilities are the behaviour policy's (what vLLM reported
when it sampled the token), so the staleness contract is that of any async sample.

Invariant: pure functions of tensors; inputs are never modified; masked-out tokens (a
multi-turn sample's environment tokens, padding) get advantage 0 and are left out of
every mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from roles.algo.masked import masked_mean

MODES = ("replace", "add")


def reverse_kl(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token `log pi_student - log pi_teacher` on masked tokens, 0 elsewhere (float32).
    On tokens the student sampled its mean estimates KL(student || teacher)."""
    return (student_logp.float() - teacher_logp.float()) * mask.float()


def distill_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Per-token advantage `-coef * (log pi_student - log pi_teacher)`, 0 off the mask."""
    return -coef * reverse_kl(student_logp, teacher_logp, mask)


def combine_advantages(task: Tensor, distill: Tensor, mode: str) -> Tensor:
    """The advantage the loss sees: the distillation term alone (`replace`), or added to the
    task reward's advantage (`add`)."""
    if mode == "replace":
        return distill.float().clone()
    if mode == "add":
        return task.float() + distill.float()
    raise ValueError(f"unknown distill mode {mode!r}; valid: {', '.join(MODES)}")


def mean_reverse_kl(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> float:
    """The mean per-token reverse KL over the masked tokens (0.0 when none): the
    `distill_kl` metric."""
    with torch.no_grad():
        return float(masked_mean(reverse_kl(student_logp, teacher_logp, mask), mask))
