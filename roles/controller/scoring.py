"""Scoring: complete groups in, rewarded groups out.

`submit(group)` queues a group whose samples are all in; `run()` scores queued groups,
up to MAX_CONCURRENT at once (a reward role each, round robin), and hands each on to `done` (the value
stage with GAE, else the ledger's `complete`). A group that cannot be scored still goes
on, with reward 0 and the failure logged, so nothing admitted is lost between completion
and training. A multi-turn sample's environment reward is added to its functions' score
(it is the whole reward when the placement has no reward role).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from roles.controller.groups import Group, SampleRec
from roles.controller.peers import Registry
from runtime.logs import get_logger
from transport import wire
from transport.rpc import RemoteError, RequestTimeout, RpcEndpoint

log = get_logger("controller")
MAX_CONCURRENT = 64  # groups being scored at once
START_SLACK_S = 30.0  # for the reward role's worker restarts (each call's own bound excludes them)


class Scorer:
    def __init__(
        self,
        server: RpcEndpoint,
        registry: Registry,
        tokenizer: Any,
        *,
        timeout_s: float,
        done: Callable[[Group], None],
        shaping: Callable[[int], float] | None = None,
        functions: int = 1,
        concurrency: int = 1,
    ) -> None:
        """`timeout_s`: the reward role's bound per call; it runs `concurrency` calls at once
        and a sample takes `functions` calls. A request's deadline is what the calls queued
        at that role (this request's and those sent before it) can take at that bound, twice
        over, plus START_SLACK_S: only a wedged reward role misses it.
        `shaping(length)`: added to each sample's reward (overlong punishment), if given."""
        self.shaping = shaping
        self.functions = functions
        self.concurrency = concurrency
        self._outstanding: Counter[bytes] = Counter()  # samples sent to each reward role, unanswered
        self.server = server
        self.registry = registry
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.done = done
        self.queue: asyncio.Queue[tuple[Group, Callable[[Group], None] | None]] = asyncio.Queue()
        self._next_reward = 0

    def submit(self, group: Group, done: Callable[[Group], None] | None = None) -> None:
        """Score `group`, then hand it to `done` (given: no shaping either, as for validation)
        or to the scorer's own `done`."""
        self.queue.put_nowait((group, done))

    async def run(self) -> None:
        """Score forever; an unexpected error in any worker ends `run` with it."""
        async with asyncio.TaskGroup() as workers:
            for i in range(MAX_CONCURRENT):
                workers.create_task(self._worker(), name=f"scorer-{i}")

    async def _worker(self) -> None:
        while True:
            await self._score(*await self.queue.get())

    async def _score(self, group: Group, done: Callable[[Group], None] | None) -> None:
        scores, failure = await self._rewards(group)
        for s in group.ordered():
            score = scores.get(_sample_id(group, s))
            s.reward = (float(score.reward) if score is not None else 0.0) + (s.env_reward or 0.0)
            s.reward_error = (score.error if score is not None else failure) or ""
            if self.shaping is not None and done is None:
                s.reward += self.shaping(s.length)
        (done or self.done)(group)

    async def _rewards(self, group: Group) -> tuple[dict[int, wire.RewardScore], str]:
        """The reward role's score of each sample, or why there are none."""
        rewards = self.registry.of("reward")
        if not rewards:
            return {}, ""
        peer = rewards[self._next_reward % len(rewards)]
        self._next_reward += 1
        items = [self._item(group, s) for s in group.ordered()]
        self._outstanding[peer.identity] += len(items)
        try:
            reply = await self.server.request(
                wire.RewardRequest(items=items), peer=peer.identity, timeout=self.deadline(peer.identity)
            )
        except (RequestTimeout, RemoteError) as exc:
            log.warning("reward_failed", group=group.gid, error=str(exc))
            return {}, f"reward request failed: {exc}"
        finally:
            self._outstanding[peer.identity] -= len(items)
        assert isinstance(reply, wire.RewardResult)
        return {s.sample_id: s for s in reply.scores}, ""

    def deadline(self, identity: bytes) -> float:
        """Seconds a request just sent to reward role `identity` may take."""
        rounds = math.ceil(self._outstanding[identity] * self.functions / self.concurrency)
        return 2 * self.timeout_s * (rounds + 1) + START_SLACK_S

    def _item(self, group: Group, s: SampleRec) -> wire.RewardItem:
        ids = s.token_ids.tolist()
        return wire.RewardItem(
            sample_id=_sample_id(group, s), prompt=group.prompt.text,
            completion=self.tokenizer.decode(ids, skip_special_tokens=True), prompt_ids=group.prompt.prompt_ids,
            completion_ids=ids, answer=group.prompt.answer, metadata=group.prompt.metadata,
        )  # fmt: skip


def _sample_id(group: Group, s: SampleRec) -> int:
    return group.gid * group.n + s.index
