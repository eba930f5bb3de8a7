"""Scoring: complete groups in, rewarded groups out.

`submit(group)` queues a group whose samples are all in; `run()` scores queued groups,
up to MAX_CONCURRENT at once, and hands each on to `done` (the value stage with GAE, else
the ledger's `complete`). Each group is asked of one reward role (the rule functions) and
one reward_model role (a classifier or a judge), each kind round robin, both at once;
`combine` makes a sample's reward of their scores, the weights and the environment's
reward. A group that cannot be scored still goes on, with reward 0 from the part that
failed and the failure in the sample's `reward_error` (the training stage ends the run
when too many of a step's samples have one), so nothing admitted is lost between
completion and training. A reward that is NaN or infinite (a reward model's, an
environment's) counts as such a failure (reason `nonfinite`): no non-finite number reaches
the advantages. So does an environment's (or agent's) reward of magnitude over
`max_magnitude` (`reward.max_magnitude`; reason `env_out_of_range`): the reward functions'
own are bounded by the reward role.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from roles.controller.groups import Group, SampleRec
from roles.controller.peers import Registry
from runtime.logs import get_logger
from transport import wire
from transport.rpc import RemoteError, RequestTimeout, RpcEndpoint
from transport.throttle import Throttled

log = get_logger("controller")
MAX_CONCURRENT = 64  # groups being scored at once
START_SLACK_S = 30.0  # for the reward role's worker restarts (each call's own bound excludes them)
KINDS = ("reward", "reward_model")


@dataclass(frozen=True)
class Weights:
    """A sample's reward = functions * (the reward role's sum) + model * (the reward_model's
    score) + its environment's reward."""

    functions: float = 1.0
    model: float = 1.0


@dataclass(frozen=True)
class Bound:
    """How long one kind's calls may take: `timeout_s` per call, `concurrency` calls at once
    per role, `calls(samples)` calls for a request of that many samples."""

    timeout_s: float
    concurrency: int = 1
    per_sample: int = 1  # calls per sample (the reward role: one per function)
    per_request: int = 0  # calls per request regardless of its size (the reward model: 1)

    def calls(self, samples: int) -> int:
        return self.per_request or samples * self.per_sample


def combine(
    rule: wire.RewardScore | None, model: wire.RewardScore | None, env_reward: float | None, weights: Weights
) -> tuple[float, str]:
    """A sample's reward and its first error ("" when none). A missing score counts 0 and
    adds no error: the caller passes the request's failure as a score with an error."""
    reward = env_reward or 0.0
    error = ""
    for score, weight in ((rule, weights.functions), (model, weights.model)):
        if score is not None:
            reward += weight * float(score.reward)
            error = error or score.error
    return reward, error


def failure_reason(rule: wire.RewardScore | None, model: wire.RewardScore | None) -> str:
    """The reason of the error `combine` reports ("" when none)."""
    for score in (rule, model):
        if score is not None and score.error:
            return score.reason or "other"
    return ""


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
        model_timeout_s: float = 60.0,
        weights: Weights | None = None,
        function_names: tuple[str, ...] = (),
        max_magnitude: float = math.inf,
        teacher: Callable[[Group], Awaitable[None]] | None = None,
    ) -> None:
        """`timeout_s`: the reward role's bound per call; it runs `concurrency` calls at once
        and a sample takes `functions` calls. `model_timeout_s`: the reward_model role's bound
        on one request. A request's deadline is what the calls queued at that role (this
        request's and those sent before it) can take at that bound, twice over, plus
        START_SLACK_S: only a wedged role misses it.
        `shaping(length)`: added to each sample's reward (overlong punishment), if given;
        `function_names`: the reward functions, named in the error of a reward request that
        got no reply (they hang or the role is wedged), not the request's timeout alone.
        `teacher(group)`: sets the distillation teacher's log-probabilities on the group's samples
        (roles/controller/teaching.py), asked beside the rewards; a sample it failed gets its
        error as the reward error (reason `teacher`)."""
        self.teacher = teacher
        self.shaping = shaping
        self.function_names = function_names
        self.max_magnitude = max_magnitude
        self.bounds = {
            "reward": Bound(timeout_s, concurrency=concurrency, per_sample=functions),
            "reward_model": Bound(model_timeout_s, per_request=1),
        }
        self.weights = weights or Weights()
        self._outstanding: Counter[bytes] = Counter()  # calls sent to each role, unanswered
        self.server = server
        self.registry = registry
        self.tokenizer = tokenizer
        self.done = done
        self.queue: asyncio.Queue[tuple[Group, Callable[[Group], None] | None]] = asyncio.Queue()
        self._next: Counter[str] = Counter()
        self.noisy = Throttled(log, first=1)

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
        items = [self._item(group, s) for s in group.ordered()]
        asks: list[Awaitable[Any]] = [self._ask(kind, group.gid, items) for kind in KINDS]
        if self.teacher is not None and done is None:  # validation groups are not trained: no teacher
            asks.append(self.teacher(group))
        rule, model, *_ = await asyncio.gather(*asks)
        for s, item in zip(group.ordered(), items, strict=True):
            r, m = rule.get(item.sample_id), model.get(item.sample_id)
            s.model_reward = float(m.reward) if m is not None and not m.error else None
            s.reward, s.reward_error = combine(r, m, s.env_reward, self.weights)
            s.reward_reason = failure_reason(r, m)
            if s.env_reward is not None and math.isfinite(s.env_reward) and abs(s.env_reward) > self.max_magnitude:
                self.noisy.warning("reward_out_of_range", key="env", group=group.gid, env_reward=s.env_reward)
                s.reward = combine(r, m, None, self.weights)[0]  # the functions' part stands
                s.reward_reason = "env_out_of_range"
                s.reward_error = (
                    f"the environment's reward is {s.env_reward:g}, beyond reward.max_magnitude={self.max_magnitude:g}"
                )
            if s.teacher_error and not s.reward_error:
                s.reward_error, s.reward_reason = s.teacher_error, "teacher"
            if self.shaping is not None and done is None:
                s.reward += self.shaping(s.length)
            if not math.isfinite(s.reward):  # only the environment's part can be: the roles send finite scores
                self.noisy.warning("reward_not_finite", key="env", group=group.gid, env_reward=s.env_reward)
                s.reward, s.reward_reason = 0.0, "nonfinite"
                s.reward_error = s.reward_error or f"the environment's reward is {s.env_reward}, not a finite number"
        (done or self.done)(group)

    async def _ask(self, kind: str, gid: int, items: list[wire.RewardItem]) -> dict[int, wire.RewardScore]:
        """Role `kind`'s score of each sample; {} when the placement has none; each a score
        of 0 with the error when the request failed."""
        peers = self.registry.of(kind)
        if not peers:
            return {}
        peer = peers[self._next[kind] % len(peers)]
        self._next[kind] += 1
        calls = self.bounds[kind].calls(len(items))
        self._outstanding[peer.identity] += calls
        deadline = self.deadline(kind, peer.identity)
        try:
            reply = await self.server.request(wire.RewardRequest(items=items), peer=peer.identity, timeout=deadline)
        except (RequestTimeout, RemoteError) as exc:
            reason = "timeout" if isinstance(exc, RequestTimeout) else "request_failed"
            self.noisy.warning("reward_failed", key=f"{peer.name} {reason}", role=peer.name, group=gid, error=str(exc))
            error = f"{kind} request failed: {exc}"
            if isinstance(exc, RequestTimeout) and kind == "reward" and self.function_names:
                error = (
                    f"reward function(s) {', '.join(self.function_names)} gave {peer.name} no scores for "
                    f"{len(items)} samples in {deadline:g}s (each call bounded by reward.timeout_s="
                    f"{self.bounds[kind].timeout_s:g}s: the functions hang, or the role is wedged)"
                )
            return {it.sample_id: wire.RewardScore(it.sample_id, 0.0, error, reason) for it in items}
        finally:
            self._outstanding[peer.identity] -= calls
        assert isinstance(reply, wire.RewardResult)
        return {s.sample_id: s for s in reply.scores}

    def deadline(self, kind: str, identity: bytes) -> float:
        """Seconds a request just sent to role `identity` (of `kind`) may take."""
        b = self.bounds[kind]
        rounds = math.ceil(self._outstanding[identity] / b.concurrency)
        return 2 * b.timeout_s * (rounds + 1) + START_SLACK_S

    def _item(self, group: Group, s: SampleRec) -> wire.RewardItem:
        ids = s.token_ids.tolist()
        p = group.prompt
        return wire.RewardItem(
            sample_id=_sample_id(group, s),
            prompt=p.text,
            completion=self.tokenizer.decode(ids, skip_special_tokens=True),
            prompt_ids=p.prompt_ids,
            completion_ids=ids,
            answer=p.answer,
            metadata=p.metadata,
            messages=p.messages,
        )


def reward_metrics(samples: list[SampleRec]) -> dict[str, float]:
    """A step's reward parts: `reward_failures` (samples without a full reward), by reason
    `reward_failures_<reason>` (only the reasons met), and, when the reward_model scored any,
    `reward_model_mean` / `reward_model_std` of its scores."""
    reasons = Counter(s.reward_reason or "other" for s in samples if s.reward_error)
    out = {"reward_failures": float(sum(reasons.values()))}
    out.update({f"reward_failures_{r}": float(n) for r, n in sorted(reasons.items())})
    scores = [s.model_reward for s in samples if s.model_reward is not None]
    if scores:
        mean = sum(scores) / len(scores)
        out["reward_model_mean"] = mean
        out["reward_model_std"] = math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores))
    return out


def _sample_id(group: Group, s: SampleRec) -> int:
    return group.gid * group.n + s.index
