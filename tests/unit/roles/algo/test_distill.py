"""On-policy distillation's per-token advantage and the policy loss on it, against values
computed by hand (single- and multi-turn masks, alone and added to a task advantage)."""

from __future__ import annotations

import math

import pytest
import torch

from roles.algo import ppo_policy_loss
from roles.algo.distill import combine_advantages, distill_advantages, mean_reverse_kl, reverse_kl

STUDENT = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.25])  # behaviour log-probs of the sampled tokens
TEACHER = torch.tensor([-1.5, -1.0, -0.5, -0.1, -2.25])
CLIP = {"clip_low": 0.2, "clip_high": 0.2, "importance_cap": 10.0}


def test_advantage_is_minus_coef_times_the_reverse_kl_per_token() -> None:
    ones = torch.ones(5)
    # student - teacher: 0.5, -1.0, 0.0, -2.9, 2.0
    assert reverse_kl(STUDENT, TEACHER, ones).tolist() == pytest.approx([0.5, -1.0, 0.0, -2.9, 2.0])
    assert distill_advantages(STUDENT, TEACHER, ones, 1.0).tolist() == pytest.approx([-0.5, 1.0, 0.0, 2.9, -2.0])
    assert distill_advantages(STUDENT, TEACHER, ones, 0.5).tolist() == pytest.approx([-0.25, 0.5, 0.0, 1.45, -1.0])
    assert mean_reverse_kl(STUDENT, TEACHER, ones) == pytest.approx((0.5 - 1.0 + 0.0 - 2.9 + 2.0) / 5)


def test_multi_turn_mask_scores_only_the_models_own_tokens() -> None:
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])  # tokens 2-3: the environment's
    adv = distill_advantages(STUDENT, TEACHER, mask, 1.0)
    assert adv.tolist() == pytest.approx([-0.5, 1.0, 0.0, 0.0, -2.0])
    assert mean_reverse_kl(STUDENT, TEACHER, mask) == pytest.approx((0.5 - 1.0 + 2.0) / 3)
    assert mean_reverse_kl(STUDENT, TEACHER, torch.zeros(5)) == 0.0


def test_replace_or_add_to_the_task_advantage() -> None:
    task = torch.full((5,), 0.7)  # a GRPO advantage lies on every token of the sample
    d = distill_advantages(STUDENT, TEACHER, torch.ones(5), 1.0)
    assert combine_advantages(task, d, "replace").tolist() == pytest.approx([-0.5, 1.0, 0.0, 2.9, -2.0])
    assert combine_advantages(task, d, "add").tolist() == pytest.approx([0.2, 1.7, 0.7, 3.6, -1.3])
    with pytest.raises(ValueError, match="unknown distill mode"):
        combine_advantages(task, d, "mix")
    assert task.tolist() == pytest.approx([0.7] * 5)  # inputs untouched


def _loss(adv: torch.Tensor, mask: torch.Tensor, shift: torch.Tensor) -> float:
    """The vanilla decoupled-PPO token-mean loss with the current policy `shift` above the
    behaviour (= proximal) log-probs."""
    behav = STUDENT.unsqueeze(0)
    loss, _ = ppo_policy_loss(behav + shift.unsqueeze(0), behav, behav, adv.unsqueeze(0), mask.unsqueeze(0), **CLIP)
    return float(loss)


def test_policy_loss_on_the_distillation_advantage_on_policy() -> None:
    """Ratio 1 and importance weight 1: the loss is minus the mean advantage over the mask."""
    mask = torch.ones(5)
    adv = distill_advantages(STUDENT, TEACHER, mask, 1.0)
    assert _loss(adv, mask, torch.zeros(5)) == pytest.approx(-(-0.5 + 1.0 + 0.0 + 2.9 - 2.0) / 5)


def test_policy_loss_keeps_the_ratio_clip_and_the_mask() -> None:
    """log-ratio 0.3 on tokens 0, 1, 4 (ratio e^0.3 ≈ 1.35 > 1.2): per token max(-rA, -clip(r)A).
    token 0, A=-0.5: max(0.5 e^0.3, 0.6) = 0.5 e^0.3; token 1, A=1: max(-e^0.3, -1.2) = -1.2;
    token 4, A=-2 (multi-turn mask keeps 0, 1, 4): max(2 e^0.3, 2.4) = 2 e^0.3."""
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    adv = distill_advantages(STUDENT, TEACHER, mask, 1.0)
    shift = torch.tensor([0.3, 0.3, 0.3, 0.3, 0.3])
    r = math.exp(0.3)
    expected = (0.5 * r - 1.2 + 2.0 * r) / 3
    assert _loss(adv, mask, shift) == pytest.approx(expected, rel=1e-6)


def test_policy_loss_with_the_task_reward_added() -> None:
    """add: A = 0.7 + distill; on-policy the loss is minus the masked mean of it."""
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    adv = combine_advantages(torch.full((5,), 0.7), distill_advantages(STUDENT, TEACHER, mask, 1.0), "add")
    # masked tokens keep 0.7 in the tensor but the mask drops them from the loss
    assert adv.tolist() == pytest.approx([0.2, 1.7, 0.7, 0.7, -1.3])
    assert _loss(adv, mask, torch.zeros(5)) == pytest.approx(-(0.2 + 1.7 - 1.3) / 3)


def test_gradient_pushes_the_student_towards_the_teacher() -> None:
    """On-policy (ratio 1), d loss / d logp = -A / N: a token the teacher likes more than the
    student (A > 0) gets its log-prob raised by a descent step, one it likes less lowered."""
    mask = torch.ones(5)
    adv = distill_advantages(STUDENT, TEACHER, mask, 1.0).unsqueeze(0)
    logp = STUDENT.unsqueeze(0).clone().requires_grad_(True)
    behav = STUDENT.unsqueeze(0)
    loss, _ = ppo_policy_loss(logp, behav, behav, adv, mask.unsqueeze(0), **CLIP)
    loss.backward()
    assert logp.grad is not None
    assert (-logp.grad[0]).tolist() == pytest.approx((adv[0] / 5).tolist())
