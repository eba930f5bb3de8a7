"""The critic role: N ranks (SPMD, torch.distributed) serving value requests and training
the value model on the controller's batches.

Every rank gets its shard of each `ValueRequest` and `TrainBatch` (a collective step);
each answers with its shard's result. The critic's version counts its optimizer steps;
`ValueResult.version` says which version computed the values, and the controller
holds values to the same staleness bound as tokens.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from roles.critic.engine import CriticEngine
from runtime.checkpoint import resume_dir
from runtime.logs import get_logger
from runtime.paths import model_dir
from runtime.role import Role
from transport import wire
from transport.endpoint import Envelope

log = get_logger("critic")


class CriticRole(Role):
    kind = "critic"

    async def setup(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        started = time.perf_counter()
        self.engine: CriticEngine = await self._in_thread(CriticEngine, self.cfg, model_dir(self.cfg))
        resume = resume_dir()
        if resume is not None:
            await self._in_thread(self.engine.load, resume / "critic")
            log.info("resumed", checkpoint=str(resume), version=self.engine.version)
        log.info("engine_ready", world_size=self.engine.world_size, seconds=round(time.perf_counter() - started, 2))
        self.lock = asyncio.Lock()

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def peer_info(self) -> wire.PeerInfo:
        info = super().peer_info()
        info.version = self.engine.version
        return info

    async def handle(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        async with self.lock:
            if isinstance(msg, wire.ValueRequest):
                values, ref = await self._in_thread(self.engine.values, msg)
                return wire.ValueResult(values=values, version=self.engine.version, ref_logprobs=ref)
            if isinstance(msg, wire.TrainBatch):
                metrics = await self._in_thread(self.engine.train_step, msg)
                log.info("critic_step", step=msg.step, **{k: round(v, 5) for k, v in metrics.items()})
                return wire.TrainResult(step=msg.step, version=self.engine.version, metrics=metrics)
            if isinstance(msg, wire.SaveCheckpoint):
                await self._in_thread(self.engine.save, Path(msg.directory))
                return wire.CheckpointSaved(step=msg.step, directory=msg.directory)
        if isinstance(msg, wire.Shutdown):
            self.request_stop(msg.reason or "controller shutdown")
            return None
        return wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=f"critic does not serve {type(msg).__name__}")

    async def close(self) -> None:
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False, cancel_futures=True)
