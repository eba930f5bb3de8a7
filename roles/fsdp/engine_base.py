"""The FSDP2 engine base: what the actor and critic engines share.

It owns the process group, the device, the sharded model's AdamW with its warm-up
schedule, micro-batches kept in step across ranks, and sharded checkpoints; and the one
`train_step` every FSDP engine runs. A subclass builds `self.model` (FSDP-wrapped), calls
`_setup_optimizer`, names its metrics (`metric_names`) and implements `forward` (the
model's output for one micro-batch) and `loss` (that micro-batch's loss from it), the
hooks `MegatronEngineBase` asks for too (roles/training/train_engine.py); it may add metrics
after the step in `after_step`. It offers what `TrainEngine` names.

A step, on every rank. With `epochs` = `mini_batches` = 1: split this rank's shard into
micro-batches, padded with empty ones to the largest count of any rank, backward each
micro-batch's loss scaled by the world size (FSDP averages gradients over ranks, see
`roles/fsdp/wrap.py`), fold its metrics, reduce them over ranks and take one optimizer
step. Otherwise `prepare` first adds what the updates need that must come from the
weights before the first one (the actor's proximal logprobs, one no-grad forward), then
each epoch splits the shard into `mini_batches` seeded, shuffled mini-batches
(`roles/training/minibatch.py`: the same count on every rank, each normalised by its own
global counts) and takes one optimizer step per mini-batch, `epochs × mini_batches` in
all. The step's metrics are the mean over those optimizer steps (the max for `maxed`
names). `version` then counts one more published policy, whatever the number of steps.

Non-finite numbers never reach the weights: an optimizer step whose loss (any `summed`
metric, reduced over ranks) or gradient norm is NaN or infinite is skipped on every rank
alike (the values are the same everywhere): the gradients are zeroed, the weights, the
optimizer's moments and the learning-rate schedule stay as they were. The step's metrics
say so: `update_skipped` (the fraction of its optimizer steps skipped, as Megatron's
engine reports it), and `nonfinite_rank` / `nonfinite_micro_batch`, the first rank and
micro-batch whose own loss was not finite (-1 when every micro-batch's loss was and only
the gradient norm was not). Ending a run after several such steps is the controller's
decision (`trainer.max_nonfinite_steps`). `save` refuses weights that hold NaN or inf, so
no checkpoint (and no HF export from one) is ever written from them.
Test only: `TANDEM_TEST_NONFINITE_STEPS=3,4` in the trainer's environment makes the loss
of rank 0's first micro-batch NaN at those steps (the metrics' 1-based step numbers).

Checkpoints (`save` / `load`) use torch.distributed.checkpoint for the model (its
trainable parameters only when `frozen_base`) and the optimizer (every rank writes its
shards into one directory, loadable at another world size), plus one small
`extra-rank<r>.pt` per rank with the scheduler, the RNG states and the version. All
methods are blocking collectives unless said otherwise: every rank calls them in the
same order, from one thread.
"""

from __future__ import annotations

import math
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from roles.fsdp.offload import ParamOffload, StreamedAdamW
from roles.fsdp.wrap import (
    clip_grad_norm_,
    finish_backward,
    gradient_sync_once,
    optimizer_param_groups,
    reduces_each_micro_batch,
    sync_after,
)
from roles.training.balance import min_bins
from roles.training.distributed import init_distributed, pick_device
from roles.training.metrics import MetricNames, accumulate, mean_over_steps, reduce_metrics
from roles.training.microbatch import (
    MicroBatch,
    dummy_micro_batch,
    dummy_packed_micro_batch,
    pack_micro_batches,
    split_micro_batches,
)
from roles.training.minibatch import epoch_mini_batches
from roles.training.rng import rng_state, set_rng_state
from runtime.config import OffloadConfig, OptimConfig, RunConfig
from transport.wire import TrainBatch

NONFINITE_TEST_ENV = "TANDEM_TEST_NONFINITE_STEPS"  # test only: see the module docstring


class FSDPEngineBase(ABC):
    """Subclasses build `self.model` (already FSDP-wrapped) and call `_setup_optimizer`."""

    model: torch.nn.Module
    metric_names: ClassVar[MetricNames]

    def __init__(self, cfg: RunConfig, *, micro_batch_tokens: int, epochs: int = 1, mini_batches: int = 1) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg)
        init_distributed(self.device, cfg.trainer.collective_timeout_s)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.trainer.seed)
        self.version = 0
        self.micro_batch_tokens = micro_batch_tokens
        self.epochs = epochs
        self.num_mini_batches = mini_batches
        self.packing = False  # a subclass whose `loss` takes packed micro-batches sets it
        self.frozen_base = False  # a subclass training adapters only sets it: checkpoints skip frozen params
        self._input_tokens = [0.0, 0.0]  # (real, padded) model-input tokens of this step
        self._bad_micro_batch = -1  # this rank's first micro-batch of the step with a non-finite loss
        self._skipped = 0  # optimizer steps of this train_step skipped (non-finite loss or gradient norm)
        self._poisoned = {int(s) for s in os.environ.get(NONFINITE_TEST_ENV, "").split(",") if s.strip()}

    def _setup_optimizer(self, o: OptimConfig, offload: OffloadConfig | None = None) -> None:
        """AdamW over the model's trainable parameters (torch's fused kernels with
        `o.implementation` "fused"); with `offload.optimizer` its moments
        live in host memory (roles/fsdp/offload.py), with `offload.params` the
        parameters may move there between steps (`offload_params`)."""
        self.optim_cfg = o
        groups = optimizer_param_groups(self.model)
        hyper: dict[str, Any] = dict(lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, weight_decay=o.weight_decay)
        if o.implementation == "fused":  # runtime/config/validate.py keeps it away from the streamed (offloaded) AdamW
            hyper["fused"] = True
        if offload is not None and offload.optimizer:
            self.optimizer: torch.optim.Optimizer = StreamedAdamW(groups, chunk_bytes=offload.chunk_mb << 20, **hyper)
        else:
            self.optimizer = torch.optim.AdamW(groups, **hyper)
        self.params_home = ParamOffload(self.model, self.device) if offload is not None and offload.params else None
        warmup = max(1, o.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))

    # --- the step ----------------------------------------------------------------------
    @abstractmethod
    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> Any:
        """`model`'s output for `mb` (on the device), what `loss` takes."""

    @abstractmethod
    def loss(self, mb: MicroBatch, batch: TrainBatch, output: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss and metrics from `forward`'s `output`, `mb` already on the
        device, `batch` the rank's whole shard (for the step's global counts). The loss is
        normalised by the step's global token (or sequence) count and not scaled by the
        world size. The metrics are python floats named in `metric_names`, plus "tokens",
        the micro-batch's masked token count (the weight of `weighted` names)."""

    def after_step(self, batch: TrainBatch, metrics: dict[str, float]) -> None:
        """Called once per `train_step`, after the optimizer steps and the version count,
        with the reduced metrics, which it may add to. Does nothing unless overridden."""
        return None

    def prepare(self, batch: TrainBatch) -> TrainBatch:
        """Before several updates on `batch`: the batch with what must come from the
        weights before the first update (a collective). Returns `batch` unless overridden."""
        return batch

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`epochs × mini_batches` optimizer steps on this rank's shard; their metrics
        reduced over ranks, with grad_norm, lr, train_s, micro_batches (this rank's count,
        the same on every rank), padding_fraction (padding tokens / model-input tokens over
        all ranks; 0 when packed), optimizer_steps, update_skipped (and, when it is not 0,
        nonfinite_rank and nonfinite_micro_batch: see the module docstring)."""
        start = time.perf_counter()
        self.restore_params()
        restore_s = time.perf_counter() - start
        self._input_tokens = [0.0, 0.0]
        self._bad_micro_batch, self._skipped = -1, 0
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.epochs == 1 and self.num_mini_batches == 1:
            mbs = self.micro_batches(batch, self.micro_batch_tokens)
            metrics = self._backward(mbs, batch)
            metrics.update(self.optimizer_step(self._loss_finite(metrics)))
            num_micro = len(mbs)
            optimizer_steps = 1
        else:
            metrics, num_micro = self._ppo_updates(self.prepare(batch))
            optimizer_steps = self.epochs * self.num_mini_batches
        metrics["update_skipped"] = self._skipped / optimizer_steps
        if self._skipped:
            metrics.update(self._first_nonfinite())
        self.version += 1
        self.after_step(batch, metrics)
        metrics.update(padding_fraction=self._padding_fraction())
        metrics.update(train_s=time.perf_counter() - start, micro_batches=num_micro)
        metrics.setdefault("optimizer_steps", 1.0)
        if isinstance(self.optimizer, StreamedAdamW):
            metrics["optimizer_offload_s"] = self.optimizer.last_step_s
        if self.params_home is not None:
            metrics["params_restore_s"] = restore_s
        return metrics

    def offload_params(self) -> None:
        """Move the parameters to host memory until the next step, export or save needs them
        (only with `offload.params`; a no-op otherwise). Not a collective."""
        if self.params_home is not None:
            self.params_home.offload()

    def restore_params(self) -> None:
        """Bring offloaded parameters back to the device (a no-op when they are there)."""
        if self.params_home is not None:
            self.params_home.restore()

    def _ppo_updates(self, batch: TrainBatch) -> tuple[dict[str, float], int]:
        """Every epoch's mini-batch steps; (mean metrics over the steps, micro-batches run)."""
        steps: list[dict[str, float]] = []
        num_micro = 0
        for epoch in range(self.epochs):
            minis = epoch_mini_batches(
                batch,
                self.num_mini_batches,
                seed=self.cfg.trainer.seed,
                epoch=epoch,
                rank=self.rank,
                device=self.device,
            )
            for mini in minis:
                mbs = self.micro_batches(mini, self.micro_batch_tokens)
                m = self._backward(mbs, mini)
                m.update(self.optimizer_step(self._loss_finite(m)))
                steps.append(m)
                num_micro += len(mbs)
        return mean_over_steps(steps, self.metric_names), num_micro

    def _backward(self, mbs: list[MicroBatch], batch: TrainBatch) -> dict[str, float]:
        """Accumulate every micro-batch's gradients; their metrics reduced over ranks."""
        acc: dict[str, float] = {}
        once = gradient_sync_once(self.model) if len(mbs) > 1 else None
        reduce_each = reduces_each_micro_batch(self.cfg.fsdp)
        try:
            for i, mb in enumerate(mbs):
                if once is not None:
                    sync_after(once, i == len(mbs) - 1, reduce_each=reduce_each)
                real = float(mb.attention_mask_BT.sum())
                self._input_tokens[0] += real
                self._input_tokens[1] += real if mb.packed is not None else float(mb.attention_mask_BT.numel())
                on_device = mb.to(self.device)
                loss, m = self.loss(on_device, batch, self.forward(self.model, on_device))
                if i == 0 and self.rank == 0 and batch.step + 1 in self._poisoned:
                    loss, m = loss * math.nan, {**m, self.metric_names.summed[0]: math.nan}
                if self._bad_micro_batch < 0 and not self._loss_finite(m):
                    self._bad_micro_batch = i
                (loss * self.world_size).backward()
                finish_backward(self.model)
                accumulate(acc, m, self.metric_names)
        finally:
            if once is not None:
                sync_after(once, True)
        return reduce_metrics(acc, self.metric_names, self.device)

    def _padding_fraction(self) -> float:
        counts = torch.tensor(self._input_tokens, dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        real, total = counts.tolist()
        return 1.0 - real / total if total > 0 else 0.0

    def micro_batches(self, batch: TrainBatch, budget: int) -> list[MicroBatch]:
        """This rank's micro-batches, padded with empty ones to the largest count of any rank.
        Packed (`self.packing`): length-balanced bins of at most `budget` real tokens, as
        many on every rank as the rank that needs most (so dummies only where a rank has
        fewer sequences than that count)."""
        has = batch.cu_seqlens.numel() > 1
        if not self.packing:
            mbs = split_micro_batches(batch, budget) if has else []
            return mbs + [dummy_micro_batch(batch) for _ in range(self._max_over_ranks(len(mbs)) - len(mbs))]
        lengths = batch.cu_seqlens.diff().tolist()
        num_bins = self._max_over_ranks(min_bins(lengths, budget))
        mbs = pack_micro_batches(batch, budget, num_bins) if has else []
        return mbs + [dummy_packed_micro_batch(batch) for _ in range(self._max_over_ranks(len(mbs)) - len(mbs))]

    def _max_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def optimizer_step(self, loss_finite: bool = True) -> dict[str, float]:
        """Clip, step and advance the schedule (not the version); returns grad_norm and lr.
        With a non-finite gradient norm, or `loss_finite` False, the gradients are dropped
        instead and nothing else changes (counted in `_skipped`)."""
        grad_norm = float(clip_grad_norm_(self.model, self.optim_cfg.grad_clip or float("inf")))
        lr = float(self.scheduler.get_last_lr()[0])
        if not (loss_finite and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self._skipped += 1
            return {"grad_norm": grad_norm, "lr": lr}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}

    def _loss_finite(self, metrics: dict[str, float]) -> bool:
        """Whether the reduced losses (`summed` names) of an optimizer step are finite."""
        return all(math.isfinite(metrics.get(k, 0.0)) for k in self.metric_names.summed)

    def _first_nonfinite(self) -> dict[str, float]:
        """`nonfinite_rank` / `nonfinite_micro_batch`: the lowest rank with a micro-batch whose
        loss was not finite, and that micro-batch's index on it (-1 / -1: none; only the
        gradient norm was not finite). A collective, run on a skipped step only (every rank
        skips the same steps)."""
        slots = torch.zeros(self.world_size, dtype=torch.float64, device=self.device)
        slots[self.rank] = self._bad_micro_batch + 1.0  # one slot per rank, summed: 0 means none
        dist.all_reduce(slots)
        bad = [(r, int(v) - 1) for r, v in enumerate(slots.tolist()) if v > 0]
        rank, index = bad[0] if bad else (-1, -1)
        return {"nonfinite_rank": float(rank), "nonfinite_micro_batch": float(index)}

    def weights_finite(self) -> bool:
        """Whether every parameter (this rank's shards, then all ranks) is finite. A collective."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        flags = [torch.isfinite(t.detach()).all() for t in local if t.numel()]  # one sync for all, below
        ok = (torch.stack(flags).all() if flags else torch.tensor(True)).to(self.device, torch.int32).reshape(1)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    # --- checkpoints -----------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Write model + optimizer shards (DCP) and this rank's extra state into `directory`;
        a ValueError, and nothing written, when the weights hold NaN or inf."""
        self.restore_params()
        if not self.weights_finite():
            raise ValueError(
                f"the weights hold NaN or inf at version {self.version}: no checkpoint is written from them"
            )
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_dict_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
        extra = {
            "version": self.version,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
        }
        torch.save(extra, directory / f"extra-rank{self.rank}.pt")
        dist.barrier()

    def _state_dict_options(self) -> StateDictOptions | None:
        """Adapters only (`frozen_base`): the frozen base comes from the model files."""
        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.frozen_base else None

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (the world size may differ; RNG only for known ranks)."""
        self.restore_params()
        options = self._state_dict_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        path = directory / f"extra-rank{self.rank}.pt"
        if not path.exists():
            path = directory / "extra-rank0.pt"
        extra = torch.load(path, weights_only=False)
        self.version = int(extra["version"])
        self.scheduler.load_state_dict(extra["scheduler"])
        set_rng_state(extra["rng"])
