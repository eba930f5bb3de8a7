"""Runs reward functions named `module:function` with bounded concurrency and a timeout.

A call that raises, returns something that is not a number, returns NaN or an infinity,
returns a number of magnitude over `max_magnitude` (`reward.max_magnitude`: 1e308 is
finite, but a batch of them makes the reward mean infinite), or does not return within
the timeout scores 0.0 (no such number ever enters training); the failure is counted per
function and reason in `failures` (workers.py `REASONS`), the first of each (function,
reason) is logged with its error, and later ones only in summaries at the 10th, 100th,
1000th... (`reward_call_failed`, `count`), so every distinct failure is seen once,
whatever the volume. The run goes on (the controller ends it when too many of a step's
calls fail: `reward.max_failure_fraction`). Every call, sync or async, runs in a worker
process of a `WorkerPool` (workers.py): a hung one is killed at its timeout, so it
strands nothing and never starves the role's event loop.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from roles.reward.workers import RewardCallError, WorkerPool
from runtime.logs import get_logger
from runtime.user_functions import REWARD_ARGUMENTS, load_reward_function
from transport.throttle import Throttled

log = get_logger("reward")
ARGUMENTS = REWARD_ARGUMENTS


class RewardRunner:
    def __init__(
        self, specs: list[str], *, timeout_s: float, concurrency: int, max_magnitude: float = math.inf
    ) -> None:
        self.functions = [(spec, load_reward_function(spec)) for spec in specs]
        self.timeout_s = timeout_s
        self.max_magnitude = max_magnitude
        self.pool = WorkerPool(specs, concurrency)
        self.failures: Counter[str] = Counter()  # per function
        self.reasons: Counter[tuple[str, str]] = Counter()  # per (function, reason)
        self.noisy = Throttled(log, first=1)

    async def start(self) -> None:
        """Start the worker processes (before the first call, so no call waits for one)."""
        await self.pool.start()

    async def score(self, item: dict[str, Any]) -> tuple[float, str, str]:
        """Sum of every function's reward for one sample, the first error and its reason
        (both "" when every call gave a number)."""
        total, first_error, first_reason = 0.0, "", ""
        for spec, fn in self.functions:
            value, error, reason = await self._call(spec, fn, item)
            total += value
            if error and not first_error:
                first_error, first_reason = error, reason
        return total, first_error, first_reason

    async def _call(self, spec: str, fn: Callable[..., Any], item: dict[str, Any]) -> tuple[float, str, str]:
        try:
            value = await self.pool.call(spec, _accepted(fn, item), self.timeout_s)
            if abs(value) > self.max_magnitude:
                raise RewardCallError(
                    f"{spec} returned {value:g}, beyond reward.max_magnitude={self.max_magnitude:g}", "out_of_range"
                )
            return value, "", ""
        except RewardCallError as exc:
            error, reason = str(exc), exc.reason
        self.failures[spec] += 1
        self.reasons[spec, reason] += 1
        self.noisy.warning(
            "reward_call_failed",
            key=f"{spec} {reason}",
            function=spec,
            reason=reason,
            error=error[:500],
            failures=self.failures[spec],
        )
        return 0.0, error, reason

    def close(self) -> None:
        self.pool.close()


def _accepted(fn: Callable[..., Any], item: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: item[k] for k in ARGUMENTS}
    return {k: item[k] for k in ARGUMENTS if k in params}
