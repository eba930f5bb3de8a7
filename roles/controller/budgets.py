"""Response budgets: the `max_tokens` each training group is sampled with.

A budget is a pure function of the group id (and, for `length_dist`, the run's seed), so a
re-dispatched group gets the budget it had, and two runs with the same seed get the same
budgets group by group. What a caller may rely on:

* `rollout.length_mix_min` N > 0: log-uniform in [N, rollout.max_tokens];
* `rollout.length_dist.kind: lognormal`: log-normal with mean `mean_tokens` and log-space
  std `sigma` before clipping to [`min_tokens`, rollout.max_tokens] (the cap: the clipped
  mass lands on it, so a step holds a few groups at the cap);
* neither: no budget (every group may run to rollout.max_tokens).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from runtime.config import LengthDistConfig, RolloutConfig

Budget = Callable[[int], int]


def mixed_max_tokens(gid: int, low: int, high: int) -> int:
    """Group `gid`'s response budget, log-uniform in [low, high]: the same for a re-dispatch."""
    u = random.Random(gid).random()
    return min(high, max(low, int(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))))


def lognormal_max_tokens(gid: int, seed: int, dist: LengthDistConfig, cap: int) -> int:
    """Group `gid`'s budget drawn from `dist` (log-normal, mean `dist.mean_tokens` before the
    clip), clipped to [dist.min_tokens, cap]; the same for every call with these arguments."""
    mu = math.log(dist.mean_tokens) - dist.sigma**2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
    draw = random.Random(f"length_dist:{seed}:{gid}").lognormvariate(mu, dist.sigma)
    return min(cap, max(dist.min_tokens, round(draw)))


def response_budget(rollout: RolloutConfig, seed: int) -> Budget | None:
    """The budget of each training group under `rollout`'s options; None: rollout.max_tokens
    for every group."""
    cap, dist = rollout.max_tokens, rollout.length_dist
    if dist.kind == "lognormal":
        return lambda gid: lognormal_max_tokens(gid, seed, dist, cap)
    if rollout.length_mix_min:
        low = rollout.length_mix_min
        return lambda gid: mixed_max_tokens(gid, low, cap)
    return None
