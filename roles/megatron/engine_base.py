"""The Megatron-core engine base: what the actor and critic engines on Megatron share.

It owns the process group and megatron's parallel state (TP x PP per replica, data
parallel across replicas), the seeds (torch and megatron's CUDA RNG tracker), the DDP
wrapper and megatron's optimizer with the FSDP engines' warm-up schedule, the pipeline
schedule, and checkpoints (`roles/megatron/checkpoint.py`). A subclass builds its
model stage and hands it to `_wrap`, names its metrics (`metric_names`) and implements
`forward` (the model's output for one micro-batch) and `loss` (that micro-batch's loss);
it may implement `prepare`. The base runs the one `train_step` both engines run, as
`FSDPEngineBase` does for the FSDP engines (roles/fsdp/engine_base.py), whose subclasses
implement the same `forward` / `loss` hooks; it offers what `TrainEngine` names
(roles/training/train_engine.py).

A step, on every rank: gather the replica's shards; with `epochs` = `mini_batches` = 1,
one optimizer step on them; otherwise `prepare` first (the actor's proximal logprobs),
then `epochs × mini_batches` steps on seeded mini-batches. The step's metrics are
reduced over ranks (the mean over the optimizer steps), with train_s and
optimizer_steps; `version` then counts one more published policy.

Data: the members of one model replica (its TP x PP ranks) must see the same sequences,
so a subclass first gathers its replica's shards (`gather_shards`). Losses are scaled so
that after the schedule (which divides by the number of micro-batches) and DDP (which
averages over data-parallel ranks) the update is one step on the whole batch. All
methods are blocking collectives, called from one thread, in the same order on every rank.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from roles.megatron.checkpoint import load_megatron, save_megatron
from roles.training.distributed import init_distributed, pick_device
from roles.training.hf_loading import DTYPES
from roles.training.metrics import MetricNames, accumulate, mean_over_steps, reduce_metrics
from roles.training.microbatch import MicroBatch, dummy_micro_batch, split_micro_batches
from roles.training.minibatch import epoch_mini_batches
from runtime.config import MegatronConfig, OptimConfig, RunConfig
from transport.wire import TRAIN_BATCH_TOKEN_FIELDS, TrainBatch


class MegatronEngineBase(ABC):
    """Subclasses build their model stage and call `_wrap`; `version` counts trained batches."""

    metric_names: ClassVar[MetricNames]

    def __init__(
        self, cfg: RunConfig, m: MegatronConfig, *, micro_batch_tokens: int, epochs: int = 1, mini_batches: int = 1
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        self.cfg = cfg
        self.device = pick_device(cfg)
        init_distributed(self.device, cfg.trainer.collective_timeout_s)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp, self.pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp)
        torch.manual_seed(cfg.trainer.seed)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)
        self.megatron_cfg = m
        self.dtype = DTYPES[m.params_dtype]
        self.dp = ps.get_data_parallel_world_size()
        self.replica_group = ps.get_model_parallel_group()
        self.reports_metrics = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        self.version = 0  # batches trained (published versions)
        self.optimizer_steps = 0  # what the learning-rate warm-up counts
        self.micro_batch_tokens = micro_batch_tokens
        self.epochs = epochs
        self.num_mini_batches = mini_batches

    def _wrap(self, module: torch.nn.Module, config: Any, o: OptimConfig) -> None:
        """Wrap `module` (this rank's stage, weights loaded) in megatron's DDP and build its
        optimizer (Adam, fp32 master weights for bf16 params, distributed if configured)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        distributed = self.megatron_cfg.use_distributed_optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
        )
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
        self.optim_cfg = o
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.betas[0],
                adam_beta2=o.betas[1],
                adam_eps=o.eps,
                clip_grad=o.grad_clip,
                bf16=self.dtype == torch.bfloat16,
                fp16=False,
                params_dtype=self.dtype,
                use_distributed_optimizer=distributed,
            ),
            [self.model],
        )
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    # --- the step ----------------------------------------------------------------------
    @abstractmethod
    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """This stage's output for `mb` (on the device), what the last stage's `loss` takes."""

    @abstractmethod
    def loss(self, mb: MicroBatch, batch: TrainBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss and metrics from the last stage's `output`; `batch` is the
        replica's whole batch (for the step's global counts). The loss is normalised by the
        step's global token (or sequence) count and not scaled for the schedule or DDP. The
        metrics are python floats named in `metric_names`, plus "tokens" (the weight of
        `weighted` names)."""

    def prepare(self, batch: TrainBatch) -> TrainBatch:
        """Before several updates on `batch` (the replica's): the batch with what must come
        from the weights before the first update (a collective). Returns `batch` unless overridden."""
        return batch

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`epochs × mini_batches` optimizer steps on this replica's sequences (one when both
        are 1); their metrics reduced over ranks and averaged over the steps, with grad_norm,
        lr, update_skipped, micro_batches, train_s, optimizer_steps. `version` counts one more batch."""
        start = time.perf_counter()
        batch = gather_shards(batch, self.replica_group, self.device)
        if self.epochs == 1 and self.num_mini_batches == 1:
            metrics = self._update(batch)
        else:
            metrics = self._ppo_updates(self.prepare(batch))
        self.version += 1
        metrics.update(train_s=time.perf_counter() - start)
        metrics.setdefault("optimizer_steps", 1.0)
        return metrics

    def _forward_step(
        self, data: Iterator[MicroBatch], model: torch.nn.Module, *, batch: TrainBatch, num_microbatches: int
    ) -> tuple[torch.Tensor, Any]:
        """megatron's forward step: the stage's output and the loss function the last stage applies to it."""
        mb = next(data)
        return self.forward(model, mb), partial(self._scaled_loss, mb, batch, num_microbatches)

    def _scaled_loss(
        self, mb: MicroBatch, batch: TrainBatch, num_microbatches: int, output: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss, m = self.loss(mb, batch, output)
        # The schedule divides by num_microbatches and DDP averages over data-parallel ranks.
        return loss * (num_microbatches * self.dp), m

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on `batch` (this replica's sequences, normalised by its global
        counts). Its metrics reduced over ranks, with grad_norm, lr, update_skipped, micro_batches."""
        names = self.metric_names
        mbs = self._micro_batches(batch, self.micro_batch_tokens)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._set_lr()
        step = partial(self._forward_step, batch=batch, num_microbatches=len(mbs))
        outputs = self._run_schedule(mbs, step, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.optimizer_steps += 1
        acc = dict.fromkeys(names.all(), 0.0)
        if self.reports_metrics:
            for m in outputs:
                accumulate(acc, m, names)
        metrics = reduce_metrics(acc, names, self.device)
        metrics.update(grad_norm=float(grad_norm or 0.0), lr=lr, update_skipped=float(not ok), micro_batches=len(mbs))
        return metrics

    def _ppo_updates(self, batch: TrainBatch) -> dict[str, float]:
        """Every epoch's mini-batch steps. The members of a replica hold the same sequences,
        so the shuffle is seeded by the data-parallel rank and the counts summed over the
        data-parallel group."""
        from megatron.core import parallel_state as ps

        steps, num_micro = [], 0.0
        for epoch in range(self.epochs):
            minis = epoch_mini_batches(
                batch,
                self.num_mini_batches,
                seed=self.cfg.trainer.seed,
                epoch=epoch,
                rank=ps.get_data_parallel_rank(),
                device=self.device,
                group=ps.get_data_parallel_group(),
            )
            for mini in minis:
                steps.append(self._update(mini))
                num_micro += steps[-1]["micro_batches"]
        metrics = mean_over_steps(steps, self.metric_names)
        metrics["micro_batches"] = num_micro
        return metrics

    def _run_schedule(self, mbs: list[MicroBatch], step: Any, *, forward_only: bool) -> list[Any]:
        """megatron's schedule (pipelined when PP > 1) over `mbs`; what the last stage's loss
        functions returned, one per micro-batch (empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(  # type: ignore[no-any-return]
            forward_step_func=step,
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=max(mb.input_ids_BT.shape[1] for mb in mbs),
            micro_batch_size=max(mb.input_ids_BT.shape[0] for mb in mbs),
            forward_only=forward_only,
        )

    def _micro_batches(self, batch: TrainBatch, budget: int) -> list[MicroBatch]:
        mbs = split_micro_batches(batch, budget) if batch.cu_seqlens.numel() > 1 else []
        return [mb.to(self.device) for mb in mbs or [dummy_micro_batch(batch)]]

    def _set_lr(self) -> float:
        """The FSDP engines' schedule: linear warm-up over `optim.warmup_steps`, then constant."""
        o = self.optim_cfg
        lr = o.lr * min(1.0, (self.optimizer_steps + 1) / max(1, o.warmup_steps))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def offload_params(self) -> None:
        """Parameters stay on the GPU: `trainer.offload` is the FSDP2 actor's (validate.py refuses it here)."""
        return None

    # --- checkpoints -------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """This rank's model, optimizer, counters and RNG state into `directory`."""
        save_megatron(directory, self.model, self.optimizer, self._counters())

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote: weights, optimizer, counters and every RNG stream.
        ValueError (one line) when the checkpoint's layout (TP, PP, world size) differs."""
        counters = load_megatron(directory, self.model, self.optimizer)
        self.version = int(counters["version"])
        self.optimizer_steps = int(counters.get("optimizer_steps", self.version))

    def _counters(self) -> dict[str, int]:
        return {"version": self.version, "optimizer_steps": self.optimizer_steps}


def gather_shards(batch: TrainBatch, group: Any, device: torch.device) -> TrainBatch:
    """The concatenation, in group-rank order, of every group member's `batch`."""
    size = dist.get_world_size(group)
    if size == 1:
        return batch
    lengths = batch.cu_seqlens.diff()
    counts = torch.tensor([batch.input_ids.numel(), lengths.numel()], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(counts) for _ in range(size)]
    dist.all_gather(everyone, counts, group=group)
    tokens, seqs = [int(c[0]) for c in everyone], [int(c[1]) for c in everyone]

    def cat(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        local = torch.zeros(max(1, *sizes), dtype=t.dtype, device=device)
        local[: t.numel()] = t.to(device)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]).cpu()

    fields = {name: cat(getattr(batch, name), tokens) for name in PER_TOKEN if getattr(batch, name) is not None}
    cu = torch.zeros(sum(seqs) + 1, dtype=batch.cu_seqlens.dtype)
    cu[1:] = cat(lengths, seqs).cumsum(0)
    return TrainBatch(
        step=batch.step,
        cu_seqlens=cu,
        global_num_tokens=batch.global_num_tokens,
        global_num_seqs=batch.global_num_seqs,
        **fields,
    )


# The per-token fields `gather_shards` gathers: all of a TrainBatch's but the proximal
# logprobs, which the trainer fills in after the gather (`prepare`), and the routed experts:
# a mixture of experts trains with TP = PP = 1, where a replica is one rank and keeps its batch.
PER_TOKEN = tuple(
    f for f in TRAIN_BATCH_TOKEN_FIELDS if f not in ("proximal_logprobs", "routed_experts", "routed_mask")
)
