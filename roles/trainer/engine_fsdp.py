"""The FSDP2 actor engine: one optimizer step of decoupled PPO per training batch.

Each rank trains on its shard of the step's batch. Per-token losses are normalised by
the GLOBAL token (or sequence) count carried in the batch and scaled by the world size
before backward (FSDP averages gradients over ranks), so the update equals one step on
the whole batch. The proximal policy of decoupled PPO is the trainer's policy before the
update: with one optimizer step per batch its logprobs are exactly the detached
logprobs of the same forward pass, so no second forward is spent on them.

The frozen reference policy for `algorithm.kl.use: loss` is held here (the initial
weights, FSDP-wrapped, no gradients). All methods are blocking collectives, called from
one thread (the role runs them in a worker thread so its event loop keeps serving).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch

from roles.algo import (
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    ppo_policy_loss,
    token_logprobs,
)
from roles.trainer.engine_base import FSDPBase, accumulate
from roles.trainer.fsdp import DTYPES, finish_backward, full_state_dict_items, wrap_model_with_fsdp
from roles.trainer.microbatch import MicroBatch
from runtime.config import RunConfig
from transport.wire import TrainBatch

SUMMED = ("loss",)
WEIGHTED = (
    "clip_fraction",
    "kl_behaviour_proximal",
    "entropy",
    "importance_weight_mean",
    "truncated_fraction",
    "kl_ref",
)
MAXED = ("importance_weight_max", "ratio_max")


def load_causal_lm(model_path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation="sdpa")
    return model.to(device)


class FSDPEngine(FSDPBase):
    def __init__(self, cfg: RunConfig, model_path: Path) -> None:
        super().__init__(cfg)
        dtype = DTYPES[cfg.fsdp.param_dtype]
        model = load_causal_lm(model_path, dtype, self.device)
        if cfg.trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model = wrap_model_with_fsdp(model, cfg.fsdp, device=self.device)
        kl = cfg.algorithm.kl
        self.ref_model = None
        if kl.enabled and kl.use == "loss":
            ref = load_causal_lm(model_path, dtype, self.device).eval().requires_grad_(False)
            self.ref_model = wrap_model_with_fsdp(ref, cfg.fsdp, device=self.device)
        self.kl_ctl = (
            AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.adaptive else FixedKLController(kl.coef)
        )
        self._setup_optimizer(cfg.trainer.optim)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard; returns metrics reduced over ranks."""
        start = time.perf_counter()
        self.model.train()
        mbs = self.micro_batches(batch, self.cfg.trainer.micro_batch_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {}
        for mb in mbs:
            accumulate(acc, self._backward(mb.to(self.device), batch), SUMMED, WEIGHTED, MAXED)
        metrics = self.reduce(acc, SUMMED, WEIGHTED, MAXED)
        metrics.update(self.optimizer_step())
        self.version += 1
        if self.ref_model is not None:
            self.kl_ctl.update(metrics.get("kl_ref", 0.0), batch.global_num_seqs)
            metrics["kl_coef"] = self.kl_ctl.value
        metrics.update(train_s=time.perf_counter() - start, micro_batches=len(mbs))
        return metrics

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
            loss = loss + self.kl_ctl.value * aggregate(kl, mask, lc.agg, **norm)
            m["kl_ref"] = _masked_mean(kl.detach(), mask)
        (loss * self.world_size).backward()
        finish_backward(self.model)
        m.update(loss=float(loss.detach()), entropy=_masked_mean(entropy.detach(), mask), tokens=float(mask.sum()))
        return m

    def _kl_to_reference(self, ids: torch.Tensor, attn: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        assert self.ref_model is not None
        with torch.no_grad():
            ref_logp = token_logprobs(self.ref_model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:])
        return kl_penalty(logp, ref_logp, self.cfg.algorithm.kl.estimator)

    def export_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by HF name in `dtype`, on the engine's device: gathered and cast
        there, never copied to the CPU (a collective: every rank iterates to the end)."""
        for name, tensor in full_state_dict_items(self.model):
            yield name, tensor.detach().to(dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))
