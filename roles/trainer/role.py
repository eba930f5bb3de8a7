"""The actor-trainer role: one process per rank, SPMD over torch.distributed.

Each rank registers with the controller and answers every `TrainBatch` (its shard of a
step) with a `TrainResult`. After the optimizer step all ranks export the full weights
(a collective) and rank 0 pushes them to every rollout; rank 0's reply, which carries
the step's metrics, is sent only after every rollout acknowledged the new version.
Torch work runs in one dedicated thread, so the event loop keeps heartbeats flowing
during long steps.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from roles.trainer.engine_fsdp import FSDPEngine, bucketed
from roles.trainer.fsdp import DTYPES
from roles.trainer.hf_export import export_hf
from roles.trainer.weight_push import PushResult, WeightPusher
from runtime import addresses
from runtime.checkpoint import resume_dir
from runtime.logs import get_logger, set_policy_version
from runtime.paths import model_dir
from runtime.role import Role
from transport import wire
from transport.endpoint import Envelope

log = get_logger("trainer")


class TrainerRole(Role):
    kind = "trainer"

    async def setup(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        started = time.perf_counter()
        self.engine = await self._in_thread(self._build_engine)
        resume = resume_dir()
        if resume is not None:
            await self._in_thread(self.engine.load, resume / "actor")
            set_policy_version(self.engine.version)
            log.info("resumed", checkpoint=str(resume), version=self.engine.version)
        log.info("engine_ready", backend=self.cfg.trainer.backend, world_size=self.engine.world_size,
                 device=str(self.engine.device), seconds=round(time.perf_counter() - started, 2))  # fmt: skip
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

    def _build_engine(self) -> Any:
        if self.cfg.trainer.backend == "megatron":
            from roles.trainer.engine_megatron import MegatronEngine

            return MegatronEngine(self.cfg, model_dir(self.cfg))
        return FSDPEngine(self.cfg, model_dir(self.cfg))

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

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

    async def _sync(self, rollouts: list[wire.PeerInfo]) -> None:
        """Bring the named rollouts to the current version (all ranks gather, rank 0 sends)."""
        buckets = await self._in_thread(self._export)
        if buckets is not None:
            names = [f"{p.role}-{p.rank}" for p in rollouts]
            result = await self.pusher.push(self.engine.version, buckets, only=names)
            self._check_push(result)
            log.info(
                "rollouts_synced",
                rollouts=sorted(result.applied),
                version=self.engine.version,
                seconds=round(result.seconds, 3),
            )

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
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False, cancel_futures=True)
