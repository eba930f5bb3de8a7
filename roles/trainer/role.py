"""The actor-trainer role: one process per rank, SPMD over torch.distributed.

Each rank registers with the controller and answers every `TrainBatch` (its shard of a
step) with a `TrainResult`. After the optimizer step all ranks export the full weights
(a collective, bucket by bucket) and rank 0 sends each bucket to every rollout as it is
packed (roles/weights: `ipc`, `nccl` or `zmq`, chosen by `weight_sync.backend` once the
rollouts are known); rank 0's reply, which carries the step's metrics with the update's
phase times, is sent only after every rollout acknowledged the new version.
Torch work runs in one dedicated thread (`TorchRole`), so the event loop keeps
heartbeats flowing during long steps.
"""

from __future__ import annotations

import asyncio
import resource
import time
from pathlib import Path
from typing import Any

import torch

from roles.trainer.fsdp_engine import FSDPEngine
from roles.training.hf_export import export_hf
from roles.training.hf_loading import DTYPES
from roles.training.torch_role import TorchRole
from roles.training.train_engine import PolicyEngine
from roles.weights.backend import BackendError, choose_backend, make_transfer
from roles.weights.ipc import device_uuid
from roles.weights.layout import BucketPacker
from roles.weights.lora_adapters import write_adapter_dir
from roles.weights.sender import PushResult, ThreadSource, WeightSender
from runtime.config.lora_settings import adapter_config
from runtime.config.placement import trainer_gives_way
from runtime.errors import one_line
from runtime.identity import addresses
from runtime.identity.paths import model_dir
from runtime.identity.run_token import read_token
from runtime.logs import get_logger, set_policy_version
from runtime.role import FatalError
from transport import wire
from transport.endpoint import Envelope

log = get_logger("trainer")


class TrainerRole(TorchRole[PolicyEngine]):
    kind = "trainer"
    checkpoint_part = "actor"

    async def setup(self) -> None:
        await super().setup()
        self.sender: WeightSender | None = None  # rank 0, once the rollouts are known
        self.packer: BucketPacker | None = None
        self.step_lock = asyncio.Lock()
        # A colocated synchronous run: vLLM sleeps while this rank steps and wakes for the
        # update, so the rank gives its allocator cache (and, with offload.params, its
        # parameters) back first. Only on CUDA, where there is a cache to give.
        self.gives_way = self.engine.device.type == "cuda" and trainer_gives_way(self.cfg, self.ctx.rank)
        if self.ctx.rank == 0 and hasattr(self.engine, "compiled"):
            log.info("trainer_compile", compiled=self.engine.compiled, requested=self.cfg.trainer.compile)

    def _make_sender(self, rollouts: list[wire.PeerInfo]) -> WeightSender:
        """The backend `weight_sync.backend` names, or `auto`'s choice for these rollouts."""
        cfg = self.cfg
        device = self.engine.device
        uuid = device_uuid(device) if device.type == "cuda" else ""
        try:
            backend = choose_backend(cfg.weight_sync.backend, device, uuid, rollouts)
        except BackendError as exc:
            raise FatalError(str(exc)) from None
        timeout_s = cfg.weight_sync.timeout_s
        token = read_token(self.ctx.run_dir)
        host = ""
        if backend == "nccl":  # the host rollouts reach this process at, as for its sockets (127.0.0.1 on one node)
            host = addresses.advertised(f"tcp://{cfg.transport.bind_host}:0").removeprefix("tcp://").rsplit(":", 1)[0]
        transfer = make_transfer(
            backend,
            timeout_s=timeout_s,
            token=token,
            device=device,
            host=host,
            workers_per_rollout=cfg.rollout.engine.tensor_parallel_size,
        )
        pack_on = device if backend in ("ipc", "nccl") else torch.device("cpu")
        self.packer = BucketPacker(pack_on, cfg.weight_sync.bucket_mb << 20)
        opts = addresses.channel_options(cfg, self.ctx.run_dir)
        log.info("weight_sync_backend", backend=backend, requested=cfg.weight_sync.backend, pack_device=str(pack_on))
        return WeightSender(self.zmq, opts, identity=self.ctx.name, timeout_s=timeout_s, transfer=transfer)

    def build_engine(self) -> PolicyEngine:
        if self.cfg.trainer.backend == "megatron":
            from roles.trainer.megatron_engine import MegatronEngine

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
                try:
                    await self._in_thread(self._save, Path(msg.directory))
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # torch's CheckpointException is a BaseException
                    cause = save_error(exc)
                    log.error("checkpoint_save_failed", directory=msg.directory, error=cause)
                    return wire.Error(code=wire.ErrorCode.INTERNAL, message=f"{self.ctx.name}: {cause}")
            return wire.CheckpointSaved(step=msg.step, directory=msg.directory)
        if isinstance(msg, wire.SyncWeights):
            async with self.step_lock:
                failed = await self._sync(msg.rollouts)
            return wire.TrainResult(step=-1, version=self.engine.version, failed_rollouts=failed)
        if isinstance(msg, wire.Peers):
            if self.engine.rank == 0:
                if self.sender is None and msg.peers:
                    self.sender = self._make_sender(msg.peers)
                if self.sender is not None:
                    new = await self.sender.set_targets(msg.peers)
                    log.info("rollout_targets", targets=sorted(self.sender.targets), new=new)
            return None
        return self.unserved(msg)

    async def _train(self, batch: wire.TrainBatch) -> wire.Message:
        started = time.perf_counter()
        metrics = await self._torch("train_step", self.engine.train_step, batch)
        if self.engine.device.type == "cuda":
            # What the trainer had to work with (with vLLM asleep, its KV cache is free).
            metrics["cuda_free_gb"] = torch.cuda.mem_get_info(self.engine.device)[0] / 1e9
            metrics["cuda_peak_gb"] = torch.cuda.max_memory_allocated(self.engine.device) / 1e9  # since start
            metrics["cuda_reserved_gb"] = torch.cuda.max_memory_reserved(self.engine.device) / 1e9
        metrics["host_peak_gb"] = host_peak_gb()  # the plan's host figure for a trainer (offload) to compare
        if self.gives_way:  # before the update wakes vLLM: the step's cached blocks are its KV cache
            await self._in_thread(torch.cuda.empty_cache)
        version = self.engine.version
        set_policy_version(version)
        sync_started = time.perf_counter()
        try:
            result = await self._push(version)
        except torch.OutOfMemoryError as exc:
            raise self.out_of_memory("the weight export", exc) from None
        failed: list[str] = []
        if result is not None:
            failed = self._check_push(result)
            metrics["weight_sync_gb"] = result.num_bytes / 1e9
            metrics.update({f"weight_sync_{k}": v for k, v in result.phases.items()})
        metrics["weight_sync_s"] = time.perf_counter() - sync_started
        if self.gives_way:  # vLLM generates next: parameters (offload.params) and the export's cache go
            released = time.perf_counter()
            await self._in_thread(self._give_way)
            metrics["release_s"] = time.perf_counter() - released
        metrics["busy_s"] = time.perf_counter() - started
        if self.engine.rank != 0:
            return wire.TrainResult(step=batch.step, version=version)
        log.info("train_step", step=batch.step, **{k: round(v, 5) for k, v in metrics.items()})
        return wire.TrainResult(step=batch.step, version=version, metrics=metrics, failed_rollouts=failed)

    def _give_way(self) -> None:
        self.engine.offload_params()
        torch.cuda.empty_cache()

    async def _push(self, version: int, only: list[str] | None = None) -> PushResult | None:
        """Export the weights (a collective on every rank) and, on rank 0, send them to the
        rollouts bucket by bucket as they are packed; rank 0's result, None elsewhere."""
        items = self.engine.export_weights(DTYPES[self.cfg.model.dtype])
        if self.engine.rank != 0 or self.sender is None or self.packer is None:
            await self._in_thread(_drain, items)
            return None
        source = ThreadSource(self.packer.buckets(items), self.pool)
        return await self.sender.push(version, source, only=only)

    def _check_push(self, result: PushResult) -> list[str]:
        """Log every rollout the weights did not reach; fatal unless rollouts are elastic."""
        for name, err in result.failed.items():
            log.error("weight_sync_failed", rollout=name, phase=err.phase, error=str(err))
        if result.failed and not self.cfg.rollout.elastic:
            raise next(iter(result.failed.values()))
        return sorted(result.failed)

    async def _sync(self, rollouts: list[wire.PeerInfo]) -> list[str]:
        """Bring the named rollouts to the current version (all ranks gather, rank 0 sends);
        the names it could not reach (elastic runs)."""
        names = [f"{p.role}-{p.rank}" for p in rollouts]
        result = await self._push(self.engine.version, only=names)
        failed: list[str] = []
        if result is not None:
            failed = self._check_push(result)
            log.info(
                "rollouts_synced",
                rollouts=sorted(result.applied),
                version=self.engine.version,
                seconds=round(result.seconds, 3),
            )
        return failed

    def _save(self, directory: Path) -> None:
        """Sharded actor state into directory/actor, and the HF export into directory/hf
        (with LoRA: the PEFT adapter directory into directory/adapter)."""
        self.engine.save(directory / "actor")
        if not self.cfg.checkpoint.export_hf:
            return
        items = self.engine.export_weights(DTYPES[self.cfg.model.dtype])
        if not self.cfg.trainer.lora.rank:
            export_hf(items, self.engine.rank, model_dir(self.cfg), directory / "hf")
            return
        tensors = dict(items)  # a collective: every rank gathers
        if self.engine.rank == 0:
            write_adapter_dir(tensors, adapter_config(self.cfg.trainer.lora), directory / "adapter")

    async def close(self) -> None:
        sender: WeightSender | None = getattr(self, "sender", None)
        if sender is not None:
            await sender.aclose()
        await super().close()


def save_error(exc: BaseException) -> str:
    """One line saying why a save failed: for torch's CheckpointException (raised on every
    rank when one rank's write failed), each failed rank's own error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = [f"rank {r}: {_one_line(f[0] if isinstance(f, tuple) else f)}" for r, f in sorted(failures.items())]
        return f"{type(exc).__name__} ({'; '.join(parts)})"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    return one_line(exc, mark="...")


def _drain(items: Any) -> None:
    """Run an export to its end (the other ranks' gathers need this rank's part)."""
    for _ in items:
        pass


def host_peak_gb() -> float:
    """This process's resident-memory high-water mark since it started, in GB (Linux reports
    `ru_maxrss` in KiB): what the memory plan's host figure for the process estimates."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
