"""Validation: held-out prompts generated and scored between training requests.

What a caller may rely on:
* `due(step)`: a round is due after every `validation.every` steps, and at step 0 with
  `validation.at_start`.
* `start(step, version)` runs a round as a task, which sends every validation prompt (n
  samples each, the validation sampling) to the rollouts as side groups of the dispatcher: they go before new
  training prompts, never enter the ledger or a training batch, and are scored by the
  reward roles like training samples (without overlong shaping). Once all are scored, or
  after `validation.timeout_s` with what came back, it writes one record to
  metrics.jsonl: `kind: "validation"`, the `step` and trainer `policy_version` at which it
  began, the policy versions of its tokens (`val/policy_version_min`, `_max`), and
  `val/reward_mean`, `val/mean@k`, `val/pass@k` (k = `validation.n`), `val/response_len_mean`.
* One round at a time: a round due while one is running is skipped (and logged). Training
  never waits for a round; `drain()` waits for the one running (the end of a run).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine
from typing import Any

from roles.controller.dataset import Prompt
from roles.controller.dispatch import Dispatcher
from roles.controller.groups import Group
from roles.controller.schedule import NoSchedule, ScheduleLog
from runtime.config import ValidationConfig
from runtime.logs import get_logger
from transport import wire

log = get_logger("controller")


def summarize(groups: list[Group], *, k: int, pass_threshold: float) -> dict[str, float | int]:
    """The metrics of a round's scored groups (each a prompt's samples). `mean@k` is the
    mean over prompts of their samples' mean reward; `pass@k` the fraction of prompts with
    at least one sample whose reward is ≥ `pass_threshold`."""
    samples = [s for g in groups for s in g.ordered()]
    if not samples:
        return {"val/prompts": 0, "val/samples": 0}
    rewards = [float(s.reward or 0.0) for s in samples]
    per_prompt = [[float(s.reward or 0.0) for s in g.ordered()] for g in groups if g.samples]
    spans = [span for g in groups if (span := g.token_versions) is not None]
    out: dict[str, float | int] = {
        "val/prompts": len(per_prompt),
        "val/samples": len(samples),
        "val/reward_mean": sum(rewards) / len(rewards),
        f"val/mean@{k}": sum(sum(r) / len(r) for r in per_prompt) / len(per_prompt),
        f"val/pass@{k}": sum(max(r) >= pass_threshold for r in per_prompt) / len(per_prompt),
        "val/response_len_mean": sum(s.num_sampled for s in samples) / len(samples),
        "val/reward_failures": sum(1 for s in samples if s.reward_error),
        "val/sample_errors": sum(1 for s in samples if s.error),
    }
    if spans:
        out["val/policy_version_min"] = min(lo for lo, _ in spans)
        out["val/policy_version_max"] = max(hi for _, hi in spans)
    return out


class Validator:
    def __init__(
        self,
        cfg: ValidationConfig,
        prompts: list[Prompt],
        sampling: wire.SamplingSpec,
        dispatcher: Dispatcher,
        score: Callable[[Group, Callable[[Group], None]], None],
        write: Callable[[dict[str, Any]], None],
        schedule: ScheduleLog | None = None,
    ) -> None:
        """`score(group, done)`: scores the group, then calls `done(group)` (the scorer's
        `submit`); `write(record)`: appends the round's record to the metrics; `schedule`:
        where each round's span is recorded."""
        self.schedule = schedule if schedule is not None else NoSchedule()
        self.cfg = cfg
        self.prompts = prompts
        self.sampling = sampling
        self.dispatcher = dispatcher
        self.write = write
        dispatcher.on_side_done = lambda group: score(group, self.scored)
        self._gids = itertools.count(1)
        self._waiting: dict[int, Group] = {}  # the running round's groups not yet scored
        self._scored: list[Group] = []
        self._all_scored = asyncio.Event()
        self._idle = asyncio.Event()  # no round running
        self._idle.set()

    def due(self, step: int) -> bool:
        every = self.cfg.every
        return bool(every) and step % every == 0 and (step > 0 or self.cfg.at_start)

    def scored(self, group: Group) -> None:
        """A group of the running round has its rewards (a late one of a timed-out round is ignored)."""
        if self._waiting.pop(group.gid, None) is None:
            return
        self._scored.append(group)
        if not self._waiting:
            self._all_scored.set()

    def start(self, step: int, version: int) -> Coroutine[Any, Any, None] | None:
        """The round to run (as a task: `Role.spawn`), or None while one is still running."""
        if self._idle.is_set():
            self._idle.clear()
            return self.run_round(step, version)
        log.warning("validation_skipped", step=step, reason="the previous round is still running")
        return None

    async def run_round(self, step: int, version: int) -> None:
        """One round, written to the metrics when done (use `start`, which keeps it the only one)."""
        try:
            await self._round(step, version)
        finally:
            self._idle.set()

    async def _round(self, step: int, version: int) -> None:
        started, wall_started = time.monotonic(), time.time()
        groups = [
            Group(
                gid=-next(self._gids),
                prompt=p,
                n=self.sampling.n,
                request_id=f"val{step}.{i}",
                admitted_version=version,
                sampling=self.sampling,
            )
            for i, p in enumerate(self.prompts)
        ]
        self._waiting = {g.gid: g for g in groups}
        self._scored = []
        self._all_scored.clear()
        log.info("validation_started", step=step, version=version, prompts=len(groups))
        self.dispatcher.submit_side(groups)
        complete = True
        try:
            await asyncio.wait_for(self._all_scored.wait(), self.cfg.timeout_s)
        except TimeoutError:
            complete = False
            log.warning(
                "validation_incomplete",
                step=step,
                scored=len(self._scored),
                of=len(groups),
                timeout_s=self.cfg.timeout_s,
            )
        finally:
            self.dispatcher.cancel_side(self._waiting)
            self._waiting = {}
        record: dict[str, Any] = {"kind": "validation", "step": step, "policy_version": version}
        record.update(summarize(self._scored, k=self.sampling.n, pass_threshold=self.cfg.pass_threshold))
        record["val/complete"] = complete
        record["val/gen_s"] = round(time.monotonic() - started, 3)
        self.write(record)
        self.schedule.validation(step, version, wall_started, len(groups))

    async def drain(self) -> None:
        """Until the running round (if any) has written its record."""
        await self._idle.wait()
