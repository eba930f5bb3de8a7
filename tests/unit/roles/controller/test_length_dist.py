"""`rollout.length_dist`: heavy-tailed (log-normal, capped) response budgets per group,
seeded by the run's seed and the group id (a run uses them: tests/integration/test_length_dist_run.py)."""

from __future__ import annotations

import math
import statistics

import pytest

from roles.controller.budgets import lognormal_max_tokens, mixed_max_tokens, response_budget
from runtime.config import LengthDistConfig
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch

TINY = "configs/tiny_cpu.yaml"


def _budgets(dist: LengthDistConfig, cap: int, seed: int = 0, n: int = 4000) -> list[int]:
    return [lognormal_max_tokens(gid, seed, dist, cap) for gid in range(n)]


def test_median_and_mean_follow_the_parameters() -> None:
    dist = LengthDistConfig(kind="lognormal", mean_tokens=512, sigma=1.0, min_tokens=1)
    budgets = _budgets(dist, cap=10**6)  # a cap out of reach: the bare log-normal
    assert statistics.median(budgets) == pytest.approx(512 * math.exp(-0.5), rel=0.06)  # 310
    assert statistics.fmean(budgets) == pytest.approx(512, rel=0.08)


def test_the_tail_is_heavy_and_the_cap_holds_it() -> None:
    dist = LengthDistConfig(kind="lognormal", mean_tokens=512, sigma=1.0, min_tokens=16)
    budgets = _budgets(dist, cap=4096)
    median = statistics.median(budgets)
    above = sum(b > 3.6 * median for b in budgets) / len(budgets)
    assert 0.07 < above < 0.13  # P(Z > ln 3.6 = 1.28) = 1 - Phi(1.28) = 0.10
    assert max(budgets) == 4096 and min(budgets) >= 16
    at_cap = sum(b == 4096 for b in budgets) / len(budgets)
    assert 0.002 < at_cap < 0.012  # P(Z > ln(4096 / 310) = 2.58) = 0.5%: the clipped mass sits at the cap
    # A step of 16 groups gets a few long ones: the longest is several times the median.
    steps = [budgets[i : i + 16] for i in range(0, len(budgets), 16)]
    assert statistics.median(max(s) / statistics.median(s) for s in steps) > 3


def test_budgets_are_seeded_and_reproducible() -> None:
    dist = LengthDistConfig(kind="lognormal", mean_tokens=64, sigma=1.5, min_tokens=4)
    assert _budgets(dist, 512, seed=3, n=200) == _budgets(dist, 512, seed=3, n=200)
    assert _budgets(dist, 512, seed=3, n=200) != _budgets(dist, 512, seed=4, n=200)
    same = LengthDistConfig(kind="lognormal", mean_tokens=64, sigma=0.1, min_tokens=64)
    assert set(_budgets(same, 64, n=50)) == {64}  # min == cap: one budget


def test_response_budget_picks_the_configured_policy() -> None:
    lognormal = load_config(TINY, ["rollout.max_tokens=128", "rollout.length_dist.kind=lognormal",
                                   "rollout.length_dist.mean_tokens=32", "seed=7"])  # fmt: skip
    budget = response_budget(lognormal.rollout, lognormal.seed)
    assert budget is not None
    assert [budget(g) for g in range(20)] == [lognormal_max_tokens(g, 7, lognormal.rollout.length_dist, 128)
                                              for g in range(20)]  # fmt: skip
    mix = load_config(TINY, ["rollout.length_mix_min=8"]).rollout
    mixed = response_budget(mix, 0)
    assert mixed is not None and [mixed(g) for g in range(20)] == [mixed_max_tokens(g, 8, 32) for g in range(20)]
    assert response_budget(load_config(TINY).rollout, 0) is None  # default: today's behaviour


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.length_dist.kind=lognormal", "rollout.length_dist.mean_tokens=64"],
         r"rollout.length_dist.mean_tokens \(64\) must lie in \[rollout.length_dist.min_tokens \(16\), "
         r"rollout.max_tokens \(32\)\]"),
        (["rollout.length_dist.kind=lognormal", "rollout.length_dist.min_tokens=40"],
         r"rollout.length_dist.min_tokens \(40\) must not exceed rollout.max_tokens \(32\)"),
        (["rollout.length_dist.kind=lognormal", "rollout.length_mix_min=8"],
         r"rollout.length_dist and rollout.length_mix_min both set a budget"),
        (["rollout.length_dist.sigma=2"], r"rollout.length_dist.sigma=2 has no effect"),
        (["rollout.length_dist.kind=pareto"], r"'rollout.length_dist.kind'.*valid choices: off, lognormal"),
        (["rollout.length_dist.sigma=0"], r"'rollout.length_dist.sigma'"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_launch(load_config(TINY, overrides))
