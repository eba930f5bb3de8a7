"""The actor-trainer role: one process per rank, SPMD over torch.distributed.

Each rank registers with the controller and answers every `TrainBatch` (its shard of a
step) with a `TrainResult`. After the optimizer step all ranks export the full weights
(a collective) and rank 0 pushes them to every rollout; rank 0's reply, which carries
the step's metrics, is sent only after every rollout acknowledged the new version.
Torch work runs in one dedicated thread (`TorchRole`), so the event loop keeps
heartbeats flowing during long steps.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roles.trainer.engine_fsdp import FSDPEngine
from roles.trainer.weight_push import PushResult, WeightPusher
from roles.training.hf_export import bucketed, export_hf
from roles.training.models import DTYPES
from roles.training.torch_role import TorchRole
from runtime import addresses
from runtime.logs import get_logger, set_policy_version
from runtime.paths import model_dir
from transport import wire
from transport.endpoint import Envelope

if TYPE_CHECKING:
    from roles.trainer.engine_megatron import MegatronEngine

log = get_logger("trainer")


class TrainerRole(TorchRole["FSDPEngine | MegatronEngine"]):
    kind = "trainer"
    checkpoint_part = "actor"

    async def setup(self) -> None:
        await super().setup()
        self.pusher = self._make_pusher()
        self.step_lock = asyncio.Lock()

    def _make_pusher(self) -> WeightPusher:
        """`zmq`: buckets over the weights channel; `nccl`: a broadcast group per rollout
        (NCCL from a CUDA trainer, gloo from a CPU one), steered over the same channel."""
        cfg = self.cfg
        opts = addresses.channel_options(cfg, self.ctx.run_dir)
        timeout_s = cfg.weight_sync.timeout_s
        if cfg.weight_sync.backend == "zmq":
            return WeightPusher(self.zmq, opts, identity=self.ctx.name, timeout_s=timeout_s)
        from roles.trainer.weight_collective import CollectivePusher

        # The host rollouts reach this process at, as for its sockets (127.0.0.1 on one node).
        host = addresses.advertised(f"tcp://{cfg.transport.bind_host}:0").removeprefix("tcp://").rsplit(":", 1)[0]
        return CollectivePusher(
            self.zmq, opts, identity=self.ctx.name, timeout_s=timeout_s, host=host, device=self.engine.device,
            workers_per_rollout=cfg.rollout.engine.tensor_parallel_size,
        )  # fmt: skip

    def build_engine(self) -> FSDPEngine | MegatronEngine:
        if self.cfg.trainer.backend == "megatron":
            from roles.trainer.engine_megatron import MegatronEngine

            return MegatronEngine(self.cfg, model_dir(self.cfg))
        return FSDPEngine(self.cfg, model_dir(self.cfg))

    def resumed(self) -> None:
        set_policy_version(self.engine.version)

    def ready_fields(self) -> dict[str, Any]:
        return {"backend": self.cfg.trainer.backend, **super().ready_fields()}

    async def handle(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.TrainBatch):
            async with self.step_lock:
                return await self._train(msg)
        if isinstance(msg, wire.SaveCheckpoint):
            async with self.step_lock:
                await self._in_thread(self._save, Path(msg.directory))
            return wire.CheckpointSaved(step=msg.step, directory=msg.directory)
        if isinstance(msg, wire.SyncWeights):
            async with self.step_lock:
                failed = await self._sync(msg.rollouts)
            return wire.TrainResult(step=-1, version=self.engine.version, failed_rollouts=failed)
        if isinstance(msg, wire.Peers):
            if self.engine.rank == 0:
                new = await self.pusher.set_targets(msg.peers)
                log.info("rollout_targets", targets=sorted(self.pusher.targets), new=new)
            return None
        if isinstance(msg, wire.Shutdown):
            self.request_stop(msg.reason or "controller shutdown")
            return None
        return wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=f"trainer does not serve {type(msg).__name__}")

    async def _train(self, batch: wire.TrainBatch) -> wire.Message:
        started = time.perf_counter()
        metrics = await self._in_thread(self.engine.train_step, batch)
        version = self.engine.version
        set_policy_version(version)
        sync_started = time.perf_counter()
        buckets = await self._in_thread(self._export)
        failed: list[str] = []
        if buckets is not None:
            result = await self.pusher.push(version, buckets)
            failed = self._check_push(result)
            metrics["weight_sync_gb"] = result.num_bytes / 1e9
        metrics["weight_sync_s"] = time.perf_counter() - sync_started
        metrics["busy_s"] = time.perf_counter() - started
        if self.engine.rank != 0:
            return wire.TrainResult(step=batch.step, version=version)
        log.info("train_step", step=batch.step, **{k: round(v, 5) for k, v in metrics.items()})
        return wire.TrainResult(step=batch.step, version=version, metrics=metrics, failed_rollouts=failed)

    def _check_push(self, result: PushResult) -> list[str]:
        """Log every rollout the weights did not reach; fatal unless rollouts are elastic."""
        for name, err in result.failed.items():
            log.error("weight_sync_failed", rollout=name, phase=err.phase, error=str(err))
        if result.failed and not self.cfg.rollout.elastic:
            raise next(iter(result.failed.values()))
        return sorted(result.failed)

    async def _sync(self, rollouts: list[wire.PeerInfo]) -> list[str]:
        """Bring the named rollouts to the current version (all ranks gather, rank 0 sends);
        the rollouts the weights did not reach (none on other ranks)."""
        buckets = await self._in_thread(self._export)
        if buckets is None:
            return []
        names = [f"{p.role}-{p.rank}" for p in rollouts]
        result = await self.pusher.push(self.engine.version, buckets, only=names)
        failed = self._check_push(result)
        log.info(
            "rollouts_synced",
            rollouts=sorted(result.applied),
            version=self.engine.version,
            seconds=round(result.seconds, 3),
        )
        return failed

    def _save(self, directory: Path) -> None:
        """Sharded actor state into directory/actor, and the HF export into directory/hf."""
        self.engine.save(directory / "actor")
        if self.cfg.checkpoint.export_hf:
            items = self.engine.export_weights(DTYPES[self.cfg.model.dtype])
            export_hf(items, self.engine.rank, model_dir(self.cfg), directory / "hf")

    def _export(self) -> list[dict[str, Any]] | None:
        """Gather full weights on every rank (collective); rank 0 keeps them in buckets."""
        items = self.engine.export_weights(DTYPES[self.cfg.model.dtype])
        if self.engine.rank != 0:
            for _ in items:
                pass
            return None
        return list(bucketed(items, self.cfg.weight_sync.bucket_mb << 20))

    async def close(self) -> None:
        if hasattr(self, "pusher"):
            await self.pusher.aclose()
        await super().close()
