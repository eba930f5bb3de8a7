"""The FSDP2 actor engine: one optimizer step of decoupled PPO per training batch.

Each rank trains on its shard of the step's batch. Per-token losses are normalised by
the GLOBAL token (or sequence) count carried in the batch and scaled by the world size
before backward (FSDP averages gradients over ranks), so the update equals one step on
the whole batch. Ranks with fewer micro-batches run empty ones to keep collectives in
step. The proximal policy of decoupled PPO is the trainer's policy before the update:
with one optimizer step per batch its logprobs are exactly the detached logprobs of the
same forward pass, so no second forward is spent on them.

All methods are blocking and must be called from one thread (the role runs them in a
dedicated worker thread so its event loop keeps serving heartbeats).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from roles.algo import aggregate, entropy_from_logits, kl_penalty, ppo_policy_loss, token_logprobs
from roles.trainer.fsdp import (
    DTYPES,
    clip_grad_norm_,
    finish_backward,
    full_state_dict_items,
    optimizer_param_groups,
    wrap_model_with_fsdp,
)
from roles.trainer.microbatch import MicroBatch, dummy_micro_batch, split_micro_batches
from runtime.config import RunConfig
from transport.wire import TrainBatch

SUMMED = ("loss",)
TOKEN_WEIGHTED = (
    "clip_fraction",
    "kl_behaviour_proximal",
    "entropy",
    "importance_weight_mean",
    "truncated_fraction",
    "kl_ref",
)
MAXED = ("importance_weight_max", "ratio_max")


def pick_device(cfg: RunConfig) -> torch.device:
    want = cfg.trainer.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    """Join the trainer world from the launcher's RANK/WORLD_SIZE/MASTER_* variables."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)


class FSDPEngine:
    def __init__(self, cfg: RunConfig, model_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = pick_device(cfg)
        init_distributed(self.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.trainer.seed)
        dtype = DTYPES[cfg.fsdp.param_dtype]
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation="sdpa")
        model.to(self.device)
        if cfg.trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model = wrap_model_with_fsdp(model, cfg.fsdp, device=self.device)
        self.ref_model = (
            self._reference(model_path, dtype) if cfg.algorithm.kl.enabled and cfg.algorithm.kl.use == "loss" else None
        )
        o = cfg.trainer.optim
        self.optimizer = torch.optim.AdamW(
            optimizer_param_groups(self.model),
            lr=o.lr,
            betas=(o.betas[0], o.betas[1]),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        warmup = max(1, o.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.version = 0
        self.kl_coef = cfg.algorithm.kl.coef

    def _reference(self, model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation="sdpa")
        ref.to(self.device).eval().requires_grad_(False)
        return wrap_model_with_fsdp(ref, self.cfg.fsdp, device=self.device)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard; returns metrics reduced over ranks."""
        start = time.perf_counter()
        self.model.train()
        mbs = self._micro_batches(batch)
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {"tokens": 0.0}
        for mb in mbs:
            self._accumulate(acc, self._backward(mb.to(self.device), batch))
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.version += 1
        metrics = self._reduce(acc)
        metrics.update(grad_norm=grad_norm, lr=lr, train_s=time.perf_counter() - start, micro_batches=len(mbs))
        return metrics

    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        mbs = split_micro_batches(batch, self.cfg.trainer.micro_batch_tokens) if batch.cu_seqlens.numel() > 1 else []
        n = torch.tensor([len(mbs)], device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return mbs + [dummy_micro_batch(batch) for _ in range(int(n.item()) - len(mbs))]

    def _backward(self, mb: MicroBatch, batch: TrainBatch) -> dict[str, float]:
        ids = mb.input_ids_BT
        logits = self.model(input_ids=ids, attention_mask=mb.attention_mask_BT).logits[:, :-1]
        logp = token_logprobs(logits, ids[:, 1:])
        f = {k: v[:, 1:] for k, v in mb.fields.items()}
        mask = f["loss_mask"]
        norm = dict(num_tokens=batch.global_num_tokens, num_seqs=batch.global_num_seqs)
        lc = self.cfg.trainer.loss
        loss, m = ppo_policy_loss(
            logp, logp.detach(), f["behaviour_logprobs"], f["advantages"], mask,
            clip_low=lc.clip_low, clip_high=lc.clip_high, importance_cap=lc.importance_cap, agg=lc.agg, **norm,
        )  # fmt: skip
        with torch.set_grad_enabled(lc.entropy_coef > 0):
            entropy = entropy_from_logits(logits)
        if lc.entropy_coef > 0:
            loss = loss - lc.entropy_coef * aggregate(entropy, mask, lc.agg, **norm)
        if self.ref_model is not None:
            kl = self._kl_to_reference(ids, mb.attention_mask_BT, logp)
            loss = loss + self.kl_coef * aggregate(kl, mask, lc.agg, **norm)
            m["kl_ref"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        (loss * self.world_size).backward()
        finish_backward(self.model)
        m["loss"] = float(loss.detach())
        m["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        m["tokens"] = float(mask.sum())
        return m

    def _kl_to_reference(self, ids: torch.Tensor, attn: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        assert self.ref_model is not None
        with torch.no_grad():
            ref_logits = self.ref_model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            ref_logp = token_logprobs(ref_logits, ids[:, 1:])
        return kl_penalty(logp, ref_logp, self.cfg.algorithm.kl.estimator)

    @staticmethod
    def _accumulate(acc: dict[str, float], m: dict[str, float]) -> None:
        tokens = m["tokens"]
        acc["tokens"] += tokens
        for k in SUMMED:
            acc[k] = acc.get(k, 0.0) + m.get(k, 0.0)
        for k in TOKEN_WEIGHTED:
            if k in m:
                acc[k] = acc.get(k, 0.0) + m[k] * tokens
        for k in MAXED:
            if k in m:
                acc[k] = max(acc.get(k, 0.0), m[k])

    def _reduce(self, acc: dict[str, float]) -> dict[str, float]:
        names = ["tokens", *SUMMED, *[k for k in TOKEN_WEIGHTED if k in acc]]
        sums = torch.tensor([acc.get(k, 0.0) for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        maxes = torch.tensor([acc.get(k, 0.0) for k in MAXED], dtype=torch.float64, device=self.device)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        out = dict(zip(names, sums.tolist(), strict=True))
        tokens = max(out.pop("tokens"), 1.0)
        for k in TOKEN_WEIGHTED:
            if k in out:
                out[k] /= tokens
        out.update(zip(MAXED, maxes.tolist(), strict=True))
        return out

    def _clip_gradients(self) -> float:
        return float(clip_grad_norm_(self.model, self.cfg.trainer.optim.grad_clip or float("inf")))

    def export_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by HF name, on CPU in `dtype` (a collective: every rank iterates)."""
        for name, tensor in full_state_dict_items(self.model):
            yield name, tensor.detach().to("cpu", dtype)


def bucketed(items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group named tensors into dicts of at most `bucket_bytes` (one tensor may exceed it)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket
