"""`rollout.length_mix_min`: each training group's response budget is drawn log-uniformly
from [length_mix_min, max_tokens], the same for every dispatch of the group."""

from __future__ import annotations

import pytest

from roles.controller.budgets import mixed_max_tokens
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch


def test_budgets_are_log_uniform_within_bounds_and_fixed_per_group() -> None:
    budgets = [mixed_max_tokens(gid, 64, 4096) for gid in range(400)]
    assert all(64 <= b <= 4096 for b in budgets)
    assert budgets == [mixed_max_tokens(gid, 64, 4096) for gid in range(400)]
    assert max(budgets) / min(budgets) > 30
    below_512 = sum(b < 512 for b in budgets) / len(budgets)
    assert 0.4 < below_512 < 0.6  # log-uniform: log2(512/64) = 3 of the 6 octaves
    assert {mixed_max_tokens(gid, 16, 16) for gid in range(10)} == {16}


def test_a_minimum_above_max_tokens_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"rollout.length_mix_min \(40\) must not exceed rollout.max_tokens \(16\)"):
        check_launch(load_config("configs/tiny_cpu.yaml", ["rollout.length_mix_min=40", "rollout.max_tokens=16"]))
