"""The Megatron-core engine base: what the actor and critic engines on Megatron share.

It owns the process group and megatron's parallel state (TP x PP per replica, data
parallel across replicas), the seeds (torch and megatron's CUDA RNG tracker), the DDP
wrapper and megatron's optimizer with the FSDP engines' warm-up schedule, the pipeline
schedule, and checkpoints (`roles/training/megatron_checkpoint.py`). A subclass builds its
model stage, hands it to `_wrap`, and runs `_update(batch, forward_step, ...)` with a
forward step that returns megatron's `(output, loss_func)` pair.

Data: the members of one model replica (its TP x PP ranks) must see the same sequences,
so a subclass first gathers its replica's shards (`gather_shards`). Losses are scaled so
that after the schedule (which divides by the number of micro-batches) and DDP (which
averages over data-parallel ranks) the update is one step on the whole batch. All
methods are blocking collectives, called from one thread, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roles.training.distributed import init_distributed, pick_device
from roles.training.megatron_checkpoint import load_megatron, save_megatron
from roles.training.metrics import MetricNames, accumulate, mean_over_steps, reduce_metrics
from roles.training.microbatch import MicroBatch, dummy_micro_batch, split_micro_batches
from roles.training.minibatch import epoch_mini_batches
from roles.training.models import DTYPES
from runtime.config import MegatronConfig, OptimConfig, RunConfig
from transport.wire import TrainBatch

ForwardStep = Callable[..., tuple[torch.Tensor, Any]]


class MegatronEngineBase:
    """Subclasses build their model stage and call `_wrap`; `version` counts trained batches."""

    def __init__(self, cfg: RunConfig, m: MegatronConfig) -> None:
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
                optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
                adam_eps=o.eps, clip_grad=o.grad_clip, bf16=self.dtype == torch.bfloat16, fp16=False,
                params_dtype=self.dtype, use_distributed_optimizer=distributed,
            ),
            [self.model],
        )  # fmt: skip
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    # --- steps -------------------------------------------------------------------------
    def _update(self, batch: TrainBatch, step: ForwardStep, names: MetricNames, budget: int) -> dict[str, float]:
        """One optimizer step on `batch` (this replica's sequences, normalised by its global
        counts): `step(data, model, batch=, num_microbatches=)` is the schedule's forward
        step. Its metrics reduced over ranks, with grad_norm, lr, update_skipped, micro_batches."""
        mbs = self._micro_batches(batch, budget)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._set_lr()
        outputs = self._run_schedule(mbs, partial(step, batch=batch, num_microbatches=len(mbs)), forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.optimizer_steps += 1
        acc = dict.fromkeys(names.all(), 0.0)
        if self.reports_metrics:
            for m in outputs:
                accumulate(acc, m, names)
        metrics = reduce_metrics(acc, names, self.device)
        metrics.update(grad_norm=float(grad_norm or 0.0), lr=lr, update_skipped=float(not ok),
                       micro_batches=len(mbs))  # fmt: skip
        return metrics

    def _ppo_updates(
        self, batch: TrainBatch, step: ForwardStep, names: MetricNames, *, epochs: int, mini_batches: int, budget: int
    ) -> dict[str, float]:
        """Every epoch's mini-batch steps. The members of a replica hold the same sequences,
        so the shuffle is seeded by the data-parallel rank and the counts summed over the
        data-parallel group."""
        from megatron.core import parallel_state as ps

        steps, num_micro = [], 0.0
        for epoch in range(epochs):
            minis = epoch_mini_batches(
                batch, mini_batches, seed=self.cfg.trainer.seed, epoch=epoch, rank=ps.get_data_parallel_rank(),
                device=self.device, group=ps.get_data_parallel_group(),
            )  # fmt: skip
            for mini in minis:
                steps.append(self._update(mini, step, names, budget))
                num_micro += steps[-1]["micro_batches"]
        metrics = mean_over_steps(steps, names)
        metrics["micro_batches"] = num_micro
        return metrics

    def _run_schedule(self, mbs: list[MicroBatch], step: Any, *, forward_only: bool) -> list[Any]:
        """megatron's schedule (pipelined when PP > 1) over `mbs`; what the last stage's loss
        functions returned, one per micro-batch (empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(  # type: ignore[no-any-return]
            forward_step_func=step, data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs),
            seq_length=max(mb.input_ids_BT.shape[1] for mb in mbs),
            micro_batch_size=max(mb.input_ids_BT.shape[0] for mb in mbs), forward_only=forward_only,
        )  # fmt: skip

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
        step=batch.step, cu_seqlens=cu, global_num_tokens=batch.global_num_tokens,
        global_num_seqs=batch.global_num_seqs, **fields,
    )  # fmt: skip


PER_TOKEN = ("input_ids", "loss_mask", "behaviour_logprobs", "advantages", "returns", "old_values", "ref_logprobs")
