"""Each model call of an episode (multi-turn environment or agent) samples with the
Generate's settings, its own max_tokens, and under `rollout.seeded_sampling` a seed of its
own, so later turns do not replay the first turn's random draws."""

from __future__ import annotations

from roles.rollout.episode import turn_sampling
from transport.wire import SamplingSpec


def test_each_call_of_a_seeded_episode_draws_afresh_and_an_unseeded_one_stays_unseeded() -> None:
    seeded = SamplingSpec(max_tokens=32, seed=7)
    assert turn_sampling(seeded, 5, 0) == SamplingSpec(max_tokens=5, seed=7)
    later = [turn_sampling(seeded, 5, t).seed for t in range(1, 50)]
    assert len(set(later)) == len(later) and 7 not in later
    assert later == [turn_sampling(seeded, 5, t).seed for t in range(1, 50)]
    assert all(turn_sampling(SamplingSpec(), 5, t).seed is None for t in range(3))
