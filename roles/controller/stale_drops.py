"""A warning when stale drops take a run's long responses (`stale_drops`).

A group is dropped as stale when its oldest token is more than `rollout.max_staleness`
versions behind the trainer at the step that would train it (roles/controller/ledger.py).
With long-tail response lengths the drops are not random: the groups that take longest to
generate are the ones that outlast the bound. An async run then trains only the shorter
responses (a length bias in what it learns from), and what the rollout spent generating the
long ones is lost. On one H200 (1.54B, log-normal budgets of mean 512 capped at 2048,
`max_staleness` 2) 15 % of the groups were dropped, 30 of the 31 over 1500 tokens, and
nothing said so but the `dropped_stale` counts.

What a caller may rely on:

* the ledger calls `dropped(group, behind)` for each group it drops as stale (`behind`: the
  trainer's version minus the group's oldest token's), `trained(groups)` for each trained
  batch and then `check(step)`; the counts are this process's (a resumed run starts again);
* `check(step)` logs one warning for the run (`stale_drops`) once at least `MIN_GROUPS`
  groups were dropped as stale and they are more than `WARN_FRACTION` of the groups trained
  or dropped so far. It carries that fraction, the mean response length of the dropped and
  of the trained groups, and `keeps_all_at`: the `rollout.max_staleness` that would have
  kept every group dropped so far (the most versions one was behind).
"""

from __future__ import annotations

from roles.controller.groups import Group
from runtime.logs import get_logger

log = get_logger("controller")

WARN_FRACTION = 0.05
MIN_GROUPS = 4


def response_tokens(group: Group) -> float:
    """Mean sampled tokens per sample of `group` (0 without samples)."""
    samples = group.ordered()
    return sum(s.length for s in samples) / len(samples) if samples else 0.0


class StaleDropWatch:
    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.dropped_groups = 0
        self.dropped_tokens = 0.0  # sum over dropped groups of their mean sample length
        self.trained_groups = 0
        self.trained_tokens = 0.0
        self.most_behind = 0
        self.warned = False

    def dropped(self, group: Group, behind: int) -> None:
        self.dropped_groups += 1
        self.dropped_tokens += response_tokens(group)
        self.most_behind = max(self.most_behind, behind)

    def trained(self, groups: list[Group]) -> None:
        self.trained_groups += len(groups)
        self.trained_tokens += sum(response_tokens(g) for g in groups)

    def fraction(self) -> float:
        """Groups dropped as stale over those trained or dropped so far."""
        seen = self.dropped_groups + self.trained_groups
        return self.dropped_groups / seen if seen else 0.0

    def check(self, step: int) -> bool:
        """Warn (once) if the drops are past the bound; whether this call warned."""
        if self.warned or self.dropped_groups < MIN_GROUPS or self.fraction() <= WARN_FRACTION:
            return False
        self.warned = True
        dropped_mean = self.dropped_tokens / self.dropped_groups
        trained_mean = self.trained_tokens / self.trained_groups if self.trained_groups else 0.0
        log.warning(
            "stale_drops",
            step=step,
            dropped_groups=self.dropped_groups,
            dropped_fraction=round(self.fraction(), 4),
            dropped_response_tokens_mean=round(dropped_mean, 1),
            trained_response_tokens_mean=round(trained_mean, 1),
            max_staleness=self.max_staleness,
            keeps_all_at=self.most_behind,
            hint=(
                f"groups that take longer to generate than rollout.max_staleness={self.max_staleness} steps are "
                "dropped, not trained: with long responses these are the long ones. "
                f"rollout.max_staleness={self.most_behind} would have kept all so far; a lower "
                "rollout.max_tokens shortens the tail"
            ),
        )
        return True
