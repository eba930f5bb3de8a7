"""The reward_model role: scores completions with a reward model or a generative judge.

It serves the controller's `RewardRequest` as the reward role does and answers a
`RewardResult` with one score per item: the classifier's logit (`reward.model.path`,
classifier.py) or the judge's parsed verdict (`reward.judge.model`, judge.py). A sample it
cannot score gets 0.0 and an error, which the controller counts as for rule rewards
(`reward.max_failure_fraction`); the role itself lives on. It runs on the GPU its
placement `devices` name, else on CPU.
"""

from __future__ import annotations

import time
from typing import Any

from roles.reward.classifier import RewardClassifier
from roles.reward.judge import Judge
from roles.reward.role import reward_result
from runtime.identity.paths import reward_model_dir
from runtime.logs import get_logger
from runtime.role import FatalError, Role
from transport import wire
from transport.endpoint import Envelope

log = get_logger("reward_model")


class RewardModelRole(Role):
    kind = "reward_model"

    async def setup(self) -> None:
        r = self.cfg.reward
        started = time.perf_counter()
        self.scorer: Any
        if r.judge.model:
            self.scorer = Judge(r.judge)
            await self.scorer.start()
            what = {"judge": r.judge.model, "parser": r.judge.parser}
        elif r.model.path:
            path = str(reward_model_dir(self.cfg))
            self.scorer = RewardClassifier(path, r.model, _device(self.ctx.env))
            try:
                self.scorer.load()
            except (OSError, ValueError) as exc:
                raise FatalError(f"reward.model.path: {exc}") from None
            what = {"model": path, "device": self.scorer.device, "dtype": r.model.dtype}
        else:
            raise FatalError("reward_model: neither reward.model.path nor reward.judge.model is set")
        log.info("reward_model_loaded", seconds=round(time.perf_counter() - started, 2), **what)

    async def handle(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.RewardRequest):
            return reward_result(msg.items, await self.scorer.score(msg.items))
        return self.unserved(msg)

    async def close(self) -> None:
        scorer = getattr(self, "scorer", None)
        if isinstance(scorer, Judge):
            await scorer.close()
        elif scorer is not None:
            scorer.close()


def _device(env: dict[str, str]) -> str:
    """cuda when the placement gave this process GPUs (and torch sees one), else cpu."""
    if not env.get("CUDA_VISIBLE_DEVICES", "").strip():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
