"""The critic role: N ranks (SPMD, torch.distributed) serving value requests and training
the value model on the controller's batches.

Every rank gets its shard of each `ValueRequest` and `TrainBatch` (a collective step);
each answers with its shard's result. The critic's version counts its optimizer steps;
`ValueResult.version` says which version computed the values, and the controller
holds values to the same staleness bound as tokens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from roles.critic.fsdp_engine import CriticEngine
from roles.training.torch_role import TorchRole
from roles.training.train_engine import ValueEngine
from runtime.identity.paths import model_dir
from runtime.logs import get_logger
from transport import wire
from transport.endpoint import Envelope

log = get_logger("critic")


class CriticRole(TorchRole[ValueEngine]):
    kind = "critic"
    checkpoint_part = "critic"

    async def setup(self) -> None:
        await super().setup()
        self.lock = asyncio.Lock()

    def build_engine(self) -> ValueEngine:
        if self.cfg.critic.backend == "megatron":
            from roles.critic.megatron_engine import MegatronCriticEngine

            return MegatronCriticEngine(self.cfg, model_dir(self.cfg))
        return CriticEngine(self.cfg, model_dir(self.cfg))

    def ready_fields(self) -> dict[str, object]:
        return {"backend": self.cfg.critic.backend, **super().ready_fields()}

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
                await self._in_thread(self.engine.save, Path(msg.directory) / self.checkpoint_part)
                return wire.CheckpointSaved(step=msg.step, directory=msg.directory)
        return self.unserved(msg)
