"""The Megatron-core actor engine: decoupled PPO on a tensor- and pipeline-parallel GPTModel.

Process groups. The trainer ranks' default group (NCCL, made by `init_distributed`) carries
only this engine's small bookkeeping collectives (metric sums). Megatron's parallel state
makes its own TP / PP / DP groups from it; weight sync to the rollouts uses its own group
(`roles/weights/`); nothing here is shared with an FSDP engine.

Data. The controller gives every trainer rank a shard of the step's batch. The ranks of one
model replica (its TP x PP ranks) must see the same sequences, so each replica first
gathers its members' shards; data-parallel replicas train on different sequences. Losses
are normalised by the step's global token (or sequence) count and scaled so that after
megatron's pipeline schedule (which divides by the number of micro-batches) and its DDP
(which averages over data-parallel ranks) the update is one step on the whole batch, as
in the FSDP engine. Micro-batches follow `trainer.micro_batch_tokens`; with pipeline
parallelism their shapes travel with them (`variable_seq_lengths`). With
`trainer.ppo_epochs` or `trainer.mini_batches` above 1 the replica first runs one
forward-only schedule for the proximal logprobs, then takes one optimizer step per
mini-batch (seeded by the data-parallel rank, normalised by the mini-batch's counts over
the data-parallel group), as the FSDP engine does. This path has not run here
(megatron-core needs CUDA); the FSDP engine's tests cover the same mini-batch code.

Weights. The model is built from the HF directory's config and loaded from its safetensors
(`roles/trainer/megatron_convert.py` documents the mapping); `export_weights` yields HF
names and full tensors on the first pipeline stage. Megatron's mixed-precision optimizer
keeps fp32 master weights when the params are bf16. Checkpoints are per rank and resume
only with the same TP / PP / world size. All methods are blocking collectives, called from
one thread, in the same order on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from roles.algo import ppo_policy_loss
from roles.trainer.megatron_convert import ModelDims
from roles.trainer.megatron_model import (
    export_hf_weights,
    load_hf_weights,
    make_actor,
    transformer_config,
    unwrap,
)
from roles.trainer.policy_loss import policy_loss_options
from roles.training.distributed import init_distributed, pick_device
from roles.training.metrics import ACTOR_METRICS, accumulate, mean_over_steps, reduce_metrics
from roles.training.microbatch import MicroBatch, dummy_micro_batch, split_micro_batches
from roles.training.minibatch import epoch_mini_batches
from roles.training.models import DTYPES
from roles.training.rng import rng_state, set_rng_state
from runtime.config import RunConfig
from transport.wire import TrainBatch

# The FSDP actor's metrics less kl_ref (no reference policy here). Every rank reduces every
# key, so ranks that do not report (not last stage, or TP rank > 0) send zeros.
METRICS = ACTOR_METRICS.without("kl_ref")
_PER_TOKEN = ("input_ids", "loss_mask", "behaviour_logprobs", "advantages", "returns", "old_values", "ref_logprobs")


class MegatronEngine:
    def __init__(self, cfg: RunConfig, model_path: Path) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from transformers import AutoConfig

        self.cfg = cfg
        self.device = pick_device(cfg)
        init_distributed(self.device, cfg.trainer.collective_timeout_s)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        m = cfg.trainer.megatron
        tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        hf_config = AutoConfig.from_pretrained(str(model_path))
        self.dims = ModelDims.from_hf_config(hf_config)
        _check_divisible(self.dims, tp)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        torch.manual_seed(cfg.trainer.seed)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)
        self.dtype = DTYPES[m.params_dtype]
        config = transformer_config(
            self.dims, tp=tp, pp=pp, dtype=self.dtype, recompute=cfg.trainer.gradient_checkpointing
        )
        self.actor = make_actor(m.model_provider, hf_config, config, self.dims, self.device)
        load_hf_weights(self.actor, model_path, self.dims)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=m.use_distributed_optimizer
        )
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=self.actor)
        o = cfg.trainer.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
                adam_eps=o.eps, clip_grad=o.grad_clip, bf16=self.dtype == torch.bfloat16, fp16=False,
                params_dtype=self.dtype, use_distributed_optimizer=m.use_distributed_optimizer,
            ),
            [self.model],
        )  # fmt: skip
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.tp, self.pp = tp, pp
        self.dp = ps.get_data_parallel_world_size()
        self.replica_group = ps.get_model_parallel_group()
        self.reports_metrics = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        self.version = 0  # batches trained (published policies)
        self.optimizer_steps = 0  # what the learning-rate warm-up counts

    # --- training ----------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`ppo_epochs × mini_batches` optimizer steps on this replica's sequences (one when
        both are 1, with the ratio against this forward, as the FSDP engine); their metrics
        reduced over ranks and averaged over the steps. `version` counts one more batch."""
        start = time.perf_counter()
        batch = gather_shards(batch, self.replica_group, self.device)
        t = self.cfg.trainer
        if t.ppo_epochs == 1 and t.mini_batches == 1:
            metrics = self._update(batch)
        else:
            metrics = self._ppo_updates(self._with_proximal(batch))
        self.version += 1
        metrics.update(train_s=time.perf_counter() - start)
        metrics.setdefault("optimizer_steps", 1.0)
        return metrics

    def _ppo_updates(self, batch: TrainBatch) -> dict[str, float]:
        """Every epoch's mini-batch steps. The members of a replica hold the same sequences,
        so the shuffle is seeded by the data-parallel rank and the counts summed over the
        data-parallel group."""
        from megatron.core import parallel_state as ps

        t = self.cfg.trainer
        steps, num_micro = [], 0.0
        for epoch in range(t.ppo_epochs):
            minis = epoch_mini_batches(
                batch, t.mini_batches, seed=t.seed, epoch=epoch, rank=ps.get_data_parallel_rank(),
                device=self.device, group=ps.get_data_parallel_group(),
            )  # fmt: skip
            for mini in minis:
                steps.append(self._update(mini))
                num_micro += steps[-1]["micro_batches"]
        metrics = mean_over_steps(steps, METRICS)
        metrics["micro_batches"] = num_micro
        return metrics

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on `batch` (this replica's sequences, normalised by its global
        counts); its metrics reduced over ranks."""
        mbs = self._micro_batches(batch)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._set_lr()
        step = partial(self._forward_step, batch=batch, num_microbatches=len(mbs))
        outputs = self._run_schedule(mbs, step, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.optimizer_steps += 1
        acc = dict.fromkeys(METRICS.all(), 0.0)
        if self.reports_metrics:
            for m in outputs:
                accumulate(acc, m, METRICS)
        metrics = reduce_metrics(acc, METRICS, self.device)
        metrics.update(grad_norm=float(grad_norm or 0.0), lr=lr, update_skipped=float(not ok),
                       micro_batches=len(mbs))  # fmt: skip
        return metrics

    def _with_proximal(self, batch: TrainBatch) -> TrainBatch:
        """`batch` with `proximal_logprobs` from one forward-only pass before the first
        update. Only the last pipeline stage computes the loss, so only it fills them in;
        the other stages carry zeros they never read."""
        prox = torch.zeros(batch.input_ids.numel(), dtype=torch.float32)
        cu = batch.cu_seqlens.tolist()
        for i, row in enumerate(self._sequence_logprobs(batch)):
            prox[cu[i] + 1 : cu[i + 1]] = row
        return msgspec.structs.replace(batch, proximal_logprobs=prox)

    def _run_schedule(self, mbs: list[MicroBatch], step: Any, *, forward_only: bool) -> list[Any]:
        """megatron's schedule (pipelined when PP > 1) over `mbs`; what the last stage's loss
        functions returned, one per micro-batch (empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(  # type: ignore[no-any-return]
            forward_step_func=step, data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs),
            seq_length=max(mb.input_ids_BT.shape[1] for mb in mbs),
            micro_batch_size=max(mb.input_ids_BT.shape[0] for mb in mbs), forward_only=forward_only,
        )  # fmt: skip

    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        mbs = split_micro_batches(batch, self.cfg.trainer.micro_batch_tokens) if batch.cu_seqlens.numel() > 1 else []
        return [mb.to(self.device) for mb in mbs or [dummy_micro_batch(batch)]]

    def _set_lr(self) -> float:
        """The FSDP engine's schedule: linear warm-up over `optim.warmup_steps`, then constant."""
        o = self.cfg.trainer.optim
        lr = o.lr * min(1.0, (self.optimizer_steps + 1) / max(1, o.warmup_steps))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _forward_step(
        self, data: Iterator[MicroBatch], model: torch.nn.Module, *, batch: TrainBatch, num_microbatches: int
    ) -> tuple[torch.Tensor, Any]:
        mb = next(data)
        logits = model(mb.input_ids_BT, mb.attention_mask_BT)["logits"]
        return logits, partial(self._loss, mb, batch, num_microbatches)

    def _loss(
        self, mb: MicroBatch, batch: TrainBatch, num_microbatches: int, logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.no_grad():
            entropy = vocab_parallel_entropy(logits[:, :-1])
        logp = next_token_logprobs(logits, mb.input_ids_BT)
        f = {k: v[:, 1:] for k, v in mb.fields.items()}
        mask = f["loss_mask"]
        prox = f.get("proximal_logprobs", logp.detach())
        loss, m = ppo_policy_loss(
            logp, prox, f["behaviour_logprobs"], f["advantages"], mask, **policy_loss_options(self.cfg),
            num_tokens=batch.global_num_tokens, num_seqs=batch.global_num_seqs,
        )  # fmt: skip
        tokens = float(mask.sum())
        m.update(loss=float(loss.detach()), entropy=float((entropy * mask).sum()) / max(tokens, 1.0), tokens=tokens)
        # The schedule divides by num_microbatches and DDP averages over data-parallel ranks.
        return loss * (num_microbatches * self.dp), m

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch) -> list[torch.Tensor] | None:
        """Token logprobs of this replica's sequences (its members' shards, gathered), one
        float32 CPU tensor per sequence: entry t-1 is log p(token t | tokens < t). Returned
        on the rank that reports metrics (last stage, TP rank 0), None on the others."""
        rows = self._sequence_logprobs(gather_shards(batch, self.replica_group, self.device))
        return rows if self.reports_metrics else None

    @torch.no_grad()
    def _sequence_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Per-sequence token logprobs of `batch` on every last-stage rank; [] elsewhere."""
        mbs = self._micro_batches(batch)
        self.model.eval()
        outputs = self._run_schedule(mbs, self._logprobs_step, forward_only=True)
        return [row for out in outputs for row in out["logprobs"]][: batch.cu_seqlens.numel() - 1]

    def _logprobs_step(self, data: Iterator[MicroBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        mb = next(data)
        logits = model(mb.input_ids_BT, mb.attention_mask_BT)["logits"]

        def collect(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
            logp = next_token_logprobs(logits, mb.input_ids_BT)
            lengths = mb.attention_mask_BT.sum(-1).tolist()
            rows = [logp[i, : max(0, n - 1)].float().cpu() for i, n in enumerate(lengths)]
            return torch.zeros((), device=logits.device), {"logprobs": rows}

        return logits, collect

    # --- weights and checkpoints -----------------------------------------------------------
    def export_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by HF name, on CPU in `dtype`, complete on the first pipeline stage's
        ranks (global rank 0 among them). A collective: every rank iterates it to the end."""
        return export_hf_weights(self.model, self.dims, dtype)

    def _layout(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "world_size": self.world_size}

    def save(self, directory: Path) -> None:
        """This rank's model and optimizer shard into `directory/megatron-rank<r>.pt`."""
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            "layout": self._layout(),
            "model": unwrap(self.model).state_dict(),
            "optim": self.optimizer.state_dict(),
            "version": self.version,
            "optimizer_steps": self.optimizer_steps,
            "rng": rng_state(),
        }
        torch.save(state, directory / f"megatron-rank{self.rank}.pt")
        dist.barrier()

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote; ValueError when the layout (TP, PP, world size) differs."""
        path = directory / f"megatron-rank{self.rank}.pt"
        if not path.exists():
            raise ValueError(f"{directory} has no Megatron checkpoint for rank {self.rank} (layout {self._layout()})")
        state = torch.load(path, weights_only=False, map_location=self.device)
        if state["layout"] != self._layout():
            raise ValueError(f"{directory} was saved with {state['layout']}; this run has {self._layout()}")
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.version = int(state["version"])
        self.optimizer_steps = int(state.get("optimizer_steps", self.version))
        set_rng_state(state["rng"])


def _check_divisible(dims: ModelDims, tp: int) -> None:
    if dims.heads % tp or dims.kv_heads % tp:
        raise ValueError(
            f"trainer.megatron.tensor_model_parallel_size={tp} must divide the model's {dims.heads} attention "
            f"heads and {dims.kv_heads} KV heads"
        )
    if dims.ffn % tp:
        raise ValueError(f"trainer.megatron.tensor_model_parallel_size={tp} must divide intermediate_size {dims.ffn}")


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) from `[B, T, vocab / tp]` logits: `[B, T-1]`, float32."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron's cross entropy writes into its input: hand it a copy.
    return -vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), ids[:, 1:].contiguous())


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the full vocabulary from this TP rank's slice (no gradient)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    logits = logits.float()
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
    dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]


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

    fields = {name: cat(getattr(batch, name), tokens) for name in _PER_TOKEN if getattr(batch, name) is not None}
    cu = torch.zeros(sum(seqs) + 1, dtype=batch.cu_seqlens.dtype)
    cu[1:] = cat(lengths, seqs).cumsum(0)
    return TrainBatch(
        step=batch.step, cu_seqlens=cu, global_num_tokens=batch.global_num_tokens,
        global_num_seqs=batch.global_num_seqs, **fields,
    )  # fmt: skip
