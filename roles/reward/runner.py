"""Runs reward functions named `module:function` with bounded concurrency and a timeout.

A call that raises, returns something that is not a number, or does not return within
the timeout scores 0.0; the failure is logged (the first few of each function, then a
count) and counted per function in `failures`, and the run goes on (the controller ends it
when too many of a step's calls fail: `reward.max_failure_fraction`). Every call, sync or
async, runs in a worker process of a `WorkerPool` (workers.py): a hung one is killed at
its timeout, so it strands nothing and never starves the role's event loop.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

from roles.reward.workers import RewardCallError, WorkerPool
from runtime.logs import get_logger
from runtime.user_functions import REWARD_ARGUMENTS, load_reward_function

log = get_logger("reward")
ARGUMENTS = REWARD_ARGUMENTS


class RewardRunner:
    def __init__(self, specs: list[str], *, timeout_s: float, concurrency: int) -> None:
        self.functions = [(spec, load_reward_function(spec)) for spec in specs]
        self.timeout_s = timeout_s
        self.pool = WorkerPool(specs, concurrency)
        self.failures: Counter[str] = Counter()

    async def start(self) -> None:
        """Start the worker processes (before the first call, so no call waits for one)."""
        await self.pool.start()

    async def score(self, item: dict[str, Any]) -> tuple[float, str]:
        """Sum of every function's reward for one sample, and the first error (or "")."""
        total, first_error = 0.0, ""
        for spec, fn in self.functions:
            value, error = await self._call(spec, fn, item)
            total += value
            first_error = first_error or error
        return total, first_error

    async def _call(self, spec: str, fn: Callable[..., Any], item: dict[str, Any]) -> tuple[float, str]:
        try:
            return await self.pool.call(spec, _accepted(fn, item), self.timeout_s), ""
        except RewardCallError as exc:
            error = str(exc)
        self.failures[spec] += 1
        if self.failures[spec] <= 3 or self.failures[spec] % 100 == 0:
            log.warning("reward_call_failed", function=spec, error=error[:500], failures=self.failures[spec])
        return 0.0, error

    def close(self) -> None:
        self.pool.close()


def _accepted(fn: Callable[..., Any], item: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: item[k] for k in ARGUMENTS}
    return {k: item[k] for k in ARGUMENTS if k in params}
