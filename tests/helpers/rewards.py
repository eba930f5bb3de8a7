"""Misbehaving reward functions for end-to-end tests (imported by reward role processes)."""

from __future__ import annotations

import os
import time


def hangs_sometimes(completion_ids: list[int], **_: object) -> float:
    """Never returns for about one sample in 32 (a stuck verifier): each costs its worker
    (killed at the timeout, replaced by a fresh interpreter)."""
    if completion_ids and completion_ids[0] % 32 == 0:
        time.sleep(10**6)
    return 0.0


def raises_sometimes(completion_ids: list[int], **_: object) -> float:
    """Raises for about one sample in eight (a buggy verifier)."""
    if completion_ids and completion_ids[0] % 8 == 1:
        raise RuntimeError("verifier crashed")
    return 0.0


def slow_zero(**_: object) -> float:
    """Takes a quarter second and adds nothing: paces a run without using the CPU."""
    time.sleep(0.25)
    return 0.0


HOLD_ENV = "TANDEM_TEST_HOLD"


def held_zero(**_: object) -> float:
    """Like slow_zero, and while the file named by $TANDEM_TEST_HOLD exists (at most 15 min)
    does not return: a test holds the run still while something slow (a joiner's vLLM
    engine) starts, instead of racing it against the run's remaining steps."""
    slow_zero()
    hold = os.environ.get(HOLD_ENV)
    deadline = time.monotonic() + 900
    while hold and os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.2)
    return 0.0


def always_raises(completion: str) -> float:
    """A verifier that fails on every call (a bug, or the wrong data)."""
    raise KeyError("answer_field")


def wrong_signature(text: str) -> float:
    """Takes an argument no reward call passes."""
    return 0.0


def copy_task_passed(completion_ids: list[int], answer: str | None = None, **_: object) -> float:
    """1.0 when at least half the copy task is right, else 0.0: a binary reward, so whole
    groups often score alike (DAPO's dynamic sampling has something to filter)."""
    from roles.reward.builtin import copy_task

    return float(copy_task(completion_ids, answer) >= 0.5)


def nan_or_inf_sometimes(completion_ids: list[int], **_: object) -> float:
    """NaN for about one sample in ten and +inf for another (a verifier dividing by zero):
    each must count as a failure, never as a score."""
    if completion_ids and completion_ids[0] % 10 == 0:
        return float("nan")
    if completion_ids and completion_ids[0] % 10 == 1:
        return float("inf")
    return 0.0


def huge_sometimes(completion_ids: list[int], **_: object) -> float:
    """1e308 for about one sample in ten: finite, but a batch of them made the reward mean
    infinite and the loss NaN; it must count as the function's failure (out_of_range)."""
    return 1e308 if completion_ids and completion_ids[0] % 10 == 2 else 0.0
