"""`rollout.seeded_sampling`'s seeds: a group's seed is a pure function of the run's seed
and its group id, distinct between groups and between runs, and small enough that vLLM's
seed (group seed + sample index) fits a torch generator's seed."""

from __future__ import annotations

from itertools import pairwise

from roles.controller.dispatch import group_seed


def test_a_groups_seed_depends_on_the_run_seed_and_the_group_alone() -> None:
    seeds = [group_seed(0, gid) for gid in range(-64, 10_000)]  # validation groups are negative
    assert seeds == [group_seed(0, gid) for gid in range(-64, 10_000)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**48 for s in seeds)
    assert not set(seeds) & {group_seed(1, gid) for gid in range(-64, 10_000)}


def test_neighbouring_groups_do_not_share_sample_seeds() -> None:
    """Sample i draws with seed + i: with n up to 1024, groups' seed ranges never meet."""
    starts = sorted(group_seed(0, gid) for gid in range(10_000))
    assert min(b - a for a, b in pairwise(starts)) > 1024
