"""The training stage: one step at a time, the ledger's next fresh batch through the
trainer (and critic) ranks.

`step()` waits for `prompts_per_step` fresh groups (`Ledger.wait_batch`, which drops
stale ones), builds every rank's shard (advantages, packing), sends the shards to the
trainer ranks (and, with GAE, the critic ranks) through their `RankGroup`s, marks the
batch trained at the version the trainer published, and records the step's metrics (and
its span and groups in the schedule log), each with the step's phases (runtime/step_phases.py:
the window from the previous step's trainer reply to this one's).
Rollouts the new weights could not reach are reported to `on_rollout_failed`. With
`before_train` (a synchronous run: roles/controller/sleep_before_step.py), each batch is handed to the
trainer only after `before_train(version)` returned.

Non-finite training: a step whose trainer skipped its update (`update_skipped`: the loss
or gradient norm was NaN or infinite; the weights did not change) is counted
(`skipped_steps_total`) and logged (`update_skipped`, with the first rank and micro-batch
whose loss was not finite); `max_nonfinite_steps` of them in a row end the run with a
FatalError naming the steps, the micro-batch and the last checkpoint (`last_checkpoint()`).
A step cancelled before its batch went to the trainer (`in_training` False: a preemption)
gives the batch back to the ledger untrained.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from roles.controller.batching import Distill, build_train_batches
from roles.controller.groups import Group
from roles.controller.ledger import Ledger
from roles.controller.mismatch import MismatchGuard
from roles.controller.ppo import RewardKL, value_metrics, whiten_groups
from roles.controller.ranks import RankGroup
from roles.controller.schedule import NoSchedule, ScheduleLog
from roles.controller.scoring import reward_metrics
from roles.controller.step_metrics import StepRecorder
from runtime.config import AlgorithmConfig
from runtime.logs import get_logger, set_policy_version
from runtime.role import FatalError
from runtime.step_phases import StepTimes, phase_metrics
from transport import wire

log = get_logger("controller")


class StepRunner:
    def __init__(
        self,
        ledger: Ledger,
        trainers: RankGroup,
        critics: RankGroup | None,
        algorithm: AlgorithmConfig,
        recorder: StepRecorder,
        *,
        timeout_s: float,
        reward_kl: RewardKL | None,
        on_rollout_failed: Callable[[str, str], None],
        max_reward_failures: float = 1.0,
        schedule: ScheduleLog | None = None,
        before_train: Callable[[int], Awaitable[object]] | None = None,
        max_nonfinite_steps: int = 3,
        last_checkpoint: Callable[[], str] = lambda: "",
        more_metrics: Callable[[], dict[str, float]] = dict,
        agent: bool = False,
        batch_metrics: Callable[[list[Group]], dict[str, float]] | None = None,
    ) -> None:
        """`critics`: the critic ranks (PPO with GAE) or None; `timeout_s`: a step's bound;
        `before_train(version)`: awaited before each batch goes to the trainer;
        `max_reward_failures`: the fraction of a batch's samples without a reward that ends the run;
        `schedule`: where each step's span and trained groups are recorded;
        `max_nonfinite_steps`, `last_checkpoint()`: see the module docstring (the latter
        says which checkpoint a resume would continue from, "" when none); `more_metrics()`:
        added to each step's record (the dataset's skipped prompts); `agent`: samples come from
        an agent, whose turns may be grammar-constrained (mismatch.py); `batch_metrics(groups)`:
        added too, from the step's trained groups (distillation's)."""
        self.batch_metrics = batch_metrics
        self.schedule = schedule if schedule is not None else NoSchedule()
        self.ledger = ledger
        self.trainers = trainers
        self.critics = critics
        self.algorithm = algorithm
        self.recorder = recorder
        self.timeout_s = timeout_s
        self.reward_kl = reward_kl
        self.on_rollout_failed = on_rollout_failed
        self.max_reward_failures = max_reward_failures
        self.mismatch = MismatchGuard(algorithm.mismatch_warn, algorithm.mismatch_stop, agent=agent)
        self.before_train = before_train
        self.last_reply = 0.0  # Unix time of the previous step's trainer reply (0: none since the start)
        self.max_nonfinite_steps = max_nonfinite_steps
        self.last_checkpoint = last_checkpoint
        self.skipped_in_a_row: list[int] = []  # the steps of the current run of skipped updates
        self.skipped_total = 0
        self.in_training = False  # the step's batch is with the trainer (a preemption waits for it)
        self.more_metrics = more_metrics

    async def step(self) -> None:
        groups = await self.ledger.wait_batch()
        self._check_rewards(groups)
        a = self.algorithm
        if self.critics is not None and a.whiten_advantages:
            whiten_groups(groups)
        build: dict[str, Any] = dict(
            step=self.ledger.step, advantage=a.advantage, norm_by_std=a.norm_by_std, std=a.std, gamma=a.gamma
        )
        if a.distill.enabled:
            build["distill"] = Distill(coef=a.distill.coef, mode=a.distill.reward)
        batches, stats = build_train_batches(groups, num_shards=len(self.trainers), **build)
        staleness = [self.ledger.staleness(int(s.versions.min())) for g in groups for s in g.ordered() if s.length]
        try:
            slept = await self._sleep_before_train()
        except asyncio.CancelledError:
            self.ledger.untake()
            raise
        started = time.time()
        self.in_training = True
        try:
            actor, critic = await self._train(groups, batches, build)
        finally:
            self.in_training = False
        times = batch_times(
            groups,
            self.last_reply or self.recorder.started_at,
            time.time(),
            rest=slept,
            train_sent=started,
            trainer=actor.metrics,
        )
        self.last_reply = times.end
        for name in actor.failed_rollouts:
            self.on_rollout_failed(name, "new weights could not be delivered")
        self.ledger.trained(actor.version)
        self.schedule.step(self.ledger.step, actor.version, started, [g.gid for g in groups], actor.metrics, times)
        set_policy_version(actor.version)
        extra = self._ppo_metrics(groups, critic) if self.critics is not None else {}
        extra.update(reward_metrics([s for g in groups for s in g.ordered()]))
        extra.update(phase_metrics(times))
        drops = self.ledger.take_step_drops()
        drops["dropped_stale_total"] = self.ledger.dropped("stale")
        drops["dropped_filtered_total"] = self.ledger.dropped("filtered")
        skipped = float(actor.metrics.get("update_skipped", 0.0)) > 0.0
        self.skipped_total += skipped
        extra["skipped_steps_total"] = float(self.skipped_total)
        extra.update(self.more_metrics())
        if self.batch_metrics is not None:
            extra.update(self.batch_metrics(groups))
        self.recorder.record(self.ledger.step, actor, stats, staleness, drops, extra)
        self.mismatch.check(self.ledger.step, actor.metrics.get("kl_behaviour_proximal"), max(staleness, default=0))
        log.info("trained", step=self.ledger.step, uids=[g.prompt.uid for g in groups])
        self._check_finite(skipped, actor.metrics)

    def _check_finite(self, skipped: bool, metrics: dict[str, float]) -> None:
        """Count a skipped update; end the run after `max_nonfinite_steps` in a row."""
        if not skipped:
            self.skipped_in_a_row = []
            return
        step = self.ledger.step
        self.skipped_in_a_row.append(step)
        where = _nonfinite_where(metrics)
        log.warning(
            "update_skipped",
            step=step,
            loss=metrics.get("loss"),
            grad_norm=metrics.get("grad_norm"),
            where=where,
            in_a_row=len(self.skipped_in_a_row),
            limit=self.max_nonfinite_steps,
        )
        if len(self.skipped_in_a_row) < self.max_nonfinite_steps:
            return
        first = self.skipped_in_a_row[0]
        last = self.last_checkpoint()
        resume = f"the last checkpoint is {last} (resume=auto continues from it)" if last else "no checkpoint was saved"
        raise FatalError(
            f"step {step}: the loss or gradient norm was not finite {len(self.skipped_in_a_row)} steps in a row "
            f"(steps {first}-{step}, trainer.max_nonfinite_steps={self.max_nonfinite_steps}); at step {step}: "
            f"loss {metrics.get('loss')}, grad_norm {metrics.get('grad_norm')}, {where}; their updates were "
            f"skipped, so the weights are those of step {first - 1}; {resume}"
        )

    async def _sleep_before_train(self) -> tuple[float, float] | None:
        """Await `before_train` (vLLM sleeps); when it began and ended, None without it."""
        if self.before_train is None:
            return None
        began = time.time()
        await self.before_train(self.ledger.version)
        return began, time.time()

    def _check_rewards(self, groups: list[Group]) -> None:
        """A batch where more than `max_failure_fraction` of the samples got no reward ends
        the run: reward functions that fail on every call must not make a "successful" run."""
        samples = [s for g in groups for s in g.ordered()]
        failed = [s.reward_error for s in samples if s.reward_error]
        if samples and len(failed) / len(samples) > self.max_reward_failures:
            raise FatalError(
                f"step {self.ledger.step + 1}: {len(failed)} of {len(samples)} samples got no reward "
                f"(more than reward.max_failure_fraction={self.max_reward_failures:g}); first: {failed[0]}"
            )

    async def _train(
        self, groups: list[Group], batches: list[wire.TrainBatch], build: dict[str, Any]
    ) -> tuple[wire.TrainResult, wire.TrainResult | None]:
        """The actor's (rank 0's) result, and the critic's when there is one."""
        actor_call = self.trainers.call(list(batches), self.timeout_s)
        critic_replies: list[wire.Message] = []
        if self.critics is None:
            replies = await actor_call
        else:
            critic_batches = build_train_batches(groups, num_shards=len(self.critics), **build)[0]
            replies, critic_replies = await asyncio.gather(
                actor_call, self.critics.call(list(critic_batches), self.timeout_s)
            )
        actor = next(r for r in replies if isinstance(r, wire.TrainResult) and r.metrics)
        critic = next((r for r in critic_replies if isinstance(r, wire.TrainResult) and r.metrics), None)
        return actor, critic

    def _ppo_metrics(self, groups: list[Group], critic: wire.TrainResult | None) -> dict[str, float]:
        out = value_metrics(groups)
        if self.reward_kl is not None:
            out.update(self.reward_kl.update(groups))
        if critic is not None:
            out.update({f"critic_{k}": v for k, v in critic.metrics.items() if k != "explained_variance_local"})
        return out


def _nonfinite_where(metrics: dict[str, float]) -> str:
    """Which micro-batch first had a non-finite loss, as the trainer reported it."""
    rank, index = int(metrics.get("nonfinite_rank", -1)), int(metrics.get("nonfinite_micro_batch", -1))
    if rank < 0:
        return "every micro-batch's loss was finite, the gradient norm was not"
    return f"first non-finite loss in micro-batch {index} of trainer-{rank}"


def batch_times(
    groups: list[Group],
    start: float,
    end: float,
    *,
    rest: tuple[float, float] | None,
    train_sent: float,
    trainer: dict[str, float],
) -> StepTimes:
    """The step's `StepTimes` (window `start`..`end`): the batch's send, sample and scoring
    times from its groups (a time a group has not got, 0, is left out), the others as given."""

    def times(attr: str) -> list[float]:
        return [t for g in groups if (t := float(getattr(g, attr))) > 0.0]

    return StepTimes(
        start=start,
        end=end,
        dispatched=min(times("dispatched_at"), default=0.0),
        gen_started=min(times("gen_started"), default=0.0),
        first_sample=min(times("first_arrival"), default=0.0),
        last_sample=max(times("last_arrival"), default=0.0),
        ready=max(times("ready_at"), default=0.0),
        rest=rest,
        train_sent=train_sent,
        trainer=trainer,
    )
