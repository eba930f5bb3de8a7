"""When the reward role gives no reply in time (every reward call hangs), the error each
sample carries, and so the run's fatal cause, names the reward function and its bound,
not only the controller's request timeout (roles/controller/scoring.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from roles.controller.scoring import Scorer
from transport import wire
from transport.rpc import RequestTimeout


class SilentServer:
    async def request(self, msg: wire.Message, *, peer: bytes, timeout: float) -> wire.Message:
        raise RequestTimeout(f"no reply in {timeout:g}s")


class OneRewardRole:
    def of(self, kind: str) -> list[Any]:
        return [SimpleNamespace(identity=b"reward-0", name="reward-0")] if kind == "reward" else []


def test_a_reward_request_without_reply_names_the_reward_function() -> None:
    scorer = Scorer(SilentServer(), OneRewardRole(), None, timeout_s=2.0, done=lambda g: None,  # type: ignore[arg-type]
                    function_names=("my_rewards:slow_judge",))  # fmt: skip
    items = [wire.RewardItem(sample_id=i, prompt="p", completion="c") for i in range(4)]
    scores = asyncio.run(scorer._ask("reward", 7, items))
    errors = {s.error for s in scores.values()}
    assert len(scores) == 4 and len(errors) == 1
    error = errors.pop()
    assert "my_rewards:slow_judge" in error and "reward.timeout_s=2s" in error and "reward-0" in error
