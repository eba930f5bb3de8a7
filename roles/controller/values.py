"""The value stage of PPO with GAE: rewarded groups in, groups with advantages out.

Rewarded groups queue up; `run()` takes up to MAX_VALUE_GROUPS of them at a time, asks
every critic rank for the values of its shard (one request per rank, through the
critic's `RankGroup`), computes token rewards (with the optional KL penalty) and GAE per
sample, and hands each group to `done` (the ledger's `complete`). A group's
`value_version` is the critic version that valued it; the ledger holds it to the same
staleness bound as the tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from roles.controller.groups import Group
from roles.controller.ppo import RewardKL, apply_values, sample_gae, value_requests
from roles.controller.ranks import RankGroup
from transport import wire

MAX_VALUE_GROUPS = 64


class ValueStage:
    def __init__(
        self,
        critics: RankGroup,
        *,
        gamma: float,
        lam: float,
        kl: RewardKL | None,
        timeout_s: float,
        done: Callable[[Group], None],
    ) -> None:
        self.critics = critics
        self.gamma = gamma
        self.lam = lam
        self.kl = kl
        self.timeout_s = timeout_s
        self.done = done
        self.queue: asyncio.Queue[Group] = asyncio.Queue()

    def submit(self, group: Group) -> None:
        self.queue.put_nowait(group)

    async def run(self) -> None:
        while True:
            groups = [await self.queue.get()]
            while len(groups) < MAX_VALUE_GROUPS and not self.queue.empty():
                groups.append(self.queue.get_nowait())
            await self._value(groups)

    async def _value(self, groups: list[Group]) -> None:
        requests, covered = value_requests(groups, len(self.critics))
        replies = await self.critics.call(list(requests), self.timeout_s)
        version = min(r.version for r in replies if isinstance(r, wire.ValueResult))
        for pairs, reply in zip(covered, replies, strict=True):
            assert isinstance(reply, wire.ValueResult)
            apply_values(pairs, reply)
        kl_coef, estimator = (self.kl.coef, self.kl.estimator) if self.kl is not None else (0.0, None)
        for g in groups:
            g.value_version = version
            for s in g.ordered():
                sample_gae(s, gamma=self.gamma, lam=self.lam, kl_coef=kl_coef, estimator=estimator)
            self.done(g)
