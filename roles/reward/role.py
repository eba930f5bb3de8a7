"""The reward role: scores completions with the configured functions (see runner.py)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

from roles.reward.runner import RewardRunner
from runtime.logs import get_logger
from runtime.role import Role
from transport import wire
from transport.endpoint import Envelope

log = get_logger("reward")


class RewardRole(Role):
    kind = "reward"

    async def setup(self) -> None:
        r = self.cfg.reward
        self.runner = RewardRunner(
            r.functions, timeout_s=r.timeout_s, concurrency=r.concurrency, max_magnitude=r.max_magnitude
        )
        started = time.monotonic()
        await self.runner.start()  # imports paid here, bounded by workers.STARTUP_TIMEOUT_S, not by timeout_s
        log.info(
            "reward_functions",
            functions=r.functions,
            timeout_s=r.timeout_s,
            workers=r.concurrency,
            start_s=round(time.monotonic() - started, 1),
        )

    async def handle(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.RewardRequest):
            results = await asyncio.gather(*[self.runner.score(_as_dict(it)) for it in msg.items])
            return reward_result(msg.items, results)
        return self.unserved(msg)

    async def close(self) -> None:
        if hasattr(self, "runner"):
            self.runner.close()


def reward_result(
    items: Sequence[wire.RewardItem], results: Sequence[tuple[float, str] | tuple[float, str, str]]
) -> wire.RewardResult:
    """The reply to a `RewardRequest`: one score per item, in order, from its (reward, error)
    or (reward, error, reason) (a reason-less error is a reward model's: `model`). A reward
    that is NaN or infinite goes out as 0 with an error (reason `nonfinite`): such a number
    never reaches training."""
    return wire.RewardResult(scores=[_score(it, *r) for it, r in zip(items, results, strict=True)])


def _score(item: wire.RewardItem, value: float, error: str, reason: str = "") -> wire.RewardScore:
    if not math.isfinite(value):
        return wire.RewardScore(item.sample_id, 0.0, error or f"the score is {value}, not a finite number", "nonfinite")
    return wire.RewardScore(item.sample_id, value, error, (reason or "model") if error else "")


def _as_dict(item: wire.RewardItem) -> dict[str, object]:
    return {
        "prompt": item.prompt,
        "completion": item.completion,
        "answer": item.answer,
        "metadata": item.metadata,
        "prompt_ids": item.prompt_ids,
        "completion_ids": item.completion_ids,
    }
