"""From complete group to ready group: rewards from a reward role, then (PPO with GAE)
values from the critic ranks, token rewards with the optional KL penalty, and GAE.

A group that cannot be scored still leaves through `ready` with reward 0 (the failure is
logged), so nothing admitted is ever lost between completion and training.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from roles.algo import AdaptiveKLController, FixedKLController
from roles.controller.groups import Group, SampleRec
from roles.controller.ppo import apply_values, sample_gae, value_requests
from runtime.logs import get_logger
from transport import wire
from transport.rpc import RemoteError, RequestTimeout

if TYPE_CHECKING:
    from roles.controller.role import Controller

log = get_logger("controller")
MAX_VALUE_GROUPS = 64


class Scoring:
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        cfg = ctl.cfg
        self.gae = cfg.algorithm.advantage == "gae"
        kl = cfg.algorithm.kl
        self.kl_estimator = kl.estimator if kl.enabled and kl.use == "reward" else None
        self.kl_ctl = (
            AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.adaptive else FixedKLController(kl.coef)
        )
        self.reward_rr = 0
        self.value_queue: list[Group] = []
        self.value_wake = asyncio.Event()

    async def score(self, group: Group) -> None:
        """Rewards for every sample of a complete group, then values or straight to ready."""
        ctl = self.ctl
        rewards = ctl.registry.of("reward")
        scores: dict[int, float] = {}
        if rewards:
            peer = rewards[self.reward_rr % len(rewards)]
            self.reward_rr += 1
            items = [self._reward_item(group, s) for s in group.ordered()]
            timeout = ctl.cfg.reward.timeout_s * (len(items) + 2)
            try:
                reply = await ctl.server.request(wire.RewardRequest(items=items), peer=peer.identity, timeout=timeout)
                scores = {s.sample_id: s.reward for s in reply.scores}  # type: ignore[union-attr]
            except (RequestTimeout, RemoteError) as exc:
                log.warning("reward_failed", group=group.gid, error=str(exc))
        for s in group.ordered():
            s.reward = float(scores.get(self._sample_id(group, s), 0.0))
        if self.gae:
            self.value_queue.append(group)
            self.value_wake.set()
        else:
            ctl.make_ready(group)

    def _sample_id(self, group: Group, s: SampleRec) -> int:
        return group.gid * group.n + s.index

    def _reward_item(self, group: Group, s: SampleRec) -> wire.RewardItem:
        ids = s.token_ids.tolist()
        return wire.RewardItem(
            sample_id=self._sample_id(group, s), prompt=group.prompt.text,
            completion=self.ctl.tokenizer.decode(ids, skip_special_tokens=True), prompt_ids=group.prompt.prompt_ids,
            completion_ids=ids, answer=group.prompt.answer, metadata=group.prompt.metadata,
        )  # fmt: skip

    async def value_loop(self) -> None:
        """Batches queued groups into one value request per critic rank, then GAE."""
        while True:
            await self.value_wake.wait()
            self.value_wake.clear()
            while self.value_queue:
                groups, self.value_queue = self.value_queue[:MAX_VALUE_GROUPS], self.value_queue[MAX_VALUE_GROUPS:]
                await self._value(groups)

    async def _value(self, groups: list[Group]) -> None:
        ctl = self.ctl
        critics = ctl.registry.of("critic")
        requests, covered = value_requests(groups, len(critics))
        timeout = max(600.0, ctl.cfg.weight_sync.timeout_s)
        async with ctl.critic_lock:
            replies = await asyncio.gather(
                *[
                    ctl.server.request(r, peer=c.identity, timeout=timeout)
                    for r, c in zip(requests, critics, strict=True)
                ]
            )
        version = min(r.version for r in replies)  # type: ignore[union-attr]
        for pairs, reply in zip(covered, replies, strict=True):
            apply_values(pairs, reply)  # type: ignore[arg-type]
        a = ctl.cfg.algorithm
        for g in groups:
            g.value_version = version
            for s in g.ordered():
                sample_gae(s, gamma=a.gamma, lam=a.lam, kl_coef=self.kl_ctl.value, estimator=self.kl_estimator)
            ctl.make_ready(g)
