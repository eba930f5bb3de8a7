"""The FSDP2 actor engine: one optimizer step of decoupled PPO per training batch.

The step itself is `FSDPEngineBase.train_step` (roles/fsdp/engine_base.py); this engine
gives it the forward and loss of one micro-batch and the KL controller's update after the step.

Each rank trains on its shard of the step's batch. Per-token losses are normalised by
the GLOBAL token (or sequence) count carried in the batch and scaled by the world size
before backward (FSDP averages gradients over ranks), so the update equals one step on
the whole batch. The proximal policy of decoupled PPO is the trainer's policy before the
batch's first update: with one optimizer step per batch (`trainer.ppo_epochs` =
`trainer.mini_batches` = 1) its logprobs are exactly the detached logprobs of the same
forward pass, so no second forward is spent on them; with several steps `prepare` runs
one no-grad forward over the shard first and every update's ratio is taken against it.

The frozen reference policy for `algorithm.kl.use: loss` is held here (the initial
weights, FSDP-wrapped, no gradients). With `trainer.lora` (roles/training/peft_lora.py) only
PEFT adapters train, the reference is the same model with its adapter disabled, the frozen
base is stored in the mixed-precision compute dtype (float32 masters only for the adapters),
and `export_weights` yields only the adapters. All methods are blocking collectives, called from
one thread (the role runs them in a worker thread so its event loop keeps serving).

A mixture-of-experts policy (HF Qwen3-MoE / Qwen2-MoE) routes through
`roles/training/moe.py`: with `algorithm.routing_replay: rollout` every token the rollout
reported is trained on the experts vLLM routed it to; the routers' load-balancing loss
(`router_aux_loss`) is reported and added with `trainer.loss.router_aux_coef`; the expert
weights leave `export_weights` by their checkpoint names (one tensor per expert), the layout
vLLM loads and transformers saves. It is not compiled (`trainer.compile` auto).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from roles.algo import AdaptiveKLController, FixedKLController, aggregate, kl_penalty, ppo_policy_loss
from roles.fsdp.actor_forward import setup_actor_model, token_stats
from roles.fsdp.engine_base import FSDPEngineBase
from roles.fsdp.wrap import full_state_dict_items, wrap_model_with_fsdp
from roles.trainer.policy_loss import policy_loss_options
from roles.training.hf_loading import DTYPES
from roles.training.metrics import ACTOR_METRICS, MOE_METRICS
from roles.training.microbatch import MicroBatch
from roles.training.moe import (
    MoeRouting,
    checkpoint_items,
    is_moe,
    model_is_moe,
    routing_fractions,
    routing_loss_term,
)
from roles.training.peft_lora import apply_lora, store_frozen_in
from roles.weights.lora_adapters import is_adapter, peft_name
from runtime.config import RunConfig, TrainerConfig
from runtime.memory.estimate import compiles_on_gpu
from transport.wire import TrainBatch


def compiles(t: TrainerConfig, device: torch.device) -> bool:
    """`trainer.compile` on `device`: `auto` compiles the full-parameter actor on CUDA with
    torch's kernels (Liger's cannot be traced; LoRA adapters are not measured compiled)."""
    return compiles_on_gpu(t) and (device.type == "cuda" or t.compile is True)


class FSDPEngine(FSDPEngineBase):
    metric_names = ACTOR_METRICS

    def __init__(self, cfg: RunConfig, model_path: Path) -> None:
        t = cfg.trainer
        super().__init__(cfg, micro_batch_tokens=t.micro_batch_tokens, epochs=t.ppo_epochs, mini_batches=t.mini_batches)
        dtype = DTYPES[cfg.fsdp.param_dtype]
        self.packing = t.packing
        opts: dict[str, Any] = dict(
            packing=t.packing, chunk=t.logprob_chunk_tokens, kernels=t.kernels, attention_kernel=t.attention_kernel
        )
        checkpointing = t.gradient_checkpointing
        moe = model_is_moe(model_path)
        if moe and t.compile is True:
            raise ValueError(
                "trainer.compile=true: a mixture-of-experts policy is not compiled; set trainer.compile=auto"
            )
        self.compiled = compiles(t, self.device) and not moe
        model = setup_actor_model(
            model_path, dtype, self.device, gradient_checkpointing=checkpointing, compile_blocks=self.compiled, **opts
        )
        self.routing = MoeRouting(model) if is_moe(model) else None
        if self.routing is not None:
            self.metric_names = ACTOR_METRICS.plus(MOE_METRICS)  # type: ignore[misc]  # all ranks load one model
        self.lora = t.lora.rank > 0
        if self.lora:
            model = apply_lora(model, t.lora, gradient_checkpointing=checkpointing)
            self.frozen_base = True
            if cfg.fsdp.mixed_precision is not None:  # the base is only ever read in the compute dtype
                store_frozen_in(model, DTYPES[cfg.fsdp.mixed_precision.param_dtype])
        self.model = wrap_model_with_fsdp(model, cfg.fsdp, device=self.device)
        kl = cfg.algorithm.kl
        self.ref_model = None
        self.kl_in_loss = kl.enabled and kl.use == "loss"
        if self.kl_in_loss and not self.lora:  # with LoRA the reference is the base: the adapter disabled
            ref = setup_actor_model(model_path, dtype, self.device, **opts).eval().requires_grad_(False)
            self.ref_model = wrap_model_with_fsdp(ref, cfg.fsdp, device=self.device)
        self.kl_ctl = (
            AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.adaptive else FixedKLController(kl.coef)
        )
        self._setup_optimizer(cfg.trainer.optim, cfg.trainer.offload)

    def prepare(self, batch: TrainBatch) -> TrainBatch:
        """`batch` with `proximal_logprobs`: this rank's token logprobs under the weights
        before the first update, packed like `input_ids` (0 at each sequence's first token)."""
        prox = torch.zeros(batch.input_ids.numel(), dtype=torch.float32)
        with torch.no_grad():
            for mb in self.micro_batches(batch, self.micro_batch_tokens):
                on_device = mb.to(self.device)
                self._plan_routing(on_device)
                logp = token_stats(self.model, on_device, entropy_grad=False)[0].cpu()
                for i, (start, end) in enumerate(mb.spans):  # a dummy micro-batch has none
                    prox[start + 1 : end] = logp[i, : end - start - 1]
        return msgspec.structs.replace(batch, proximal_logprobs=prox)

    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Token logprobs and entropy, [B, T - 1] (entropy with a gradient only when it is in the loss);
        an MoE policy routes as `_plan_routing` says."""
        self._plan_routing(mb)
        return token_stats(model, mb, entropy_grad=self.cfg.trainer.loss.entropy_coef > 0)

    def _plan_routing(self, mb: MicroBatch) -> None:
        """An MoE policy's routing for `mb` (on the device): the rollout's experts where it
        reported them, replayed when `algorithm.routing_replay` is `rollout`, measured always."""
        if self.routing is None:
            return
        valid = None if mb.packed is not None else mb.attention_mask_BT.flatten().bool()
        experts, mask = mb.routing if mb.routing is not None else (None, None)
        replay = self.cfg.algorithm.routing_replay == "rollout"
        self.routing.plan(experts, mask, replay=replay, valid=valid)

    def loss(
        self, mb: MicroBatch, batch: TrainBatch, output: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Decoupled PPO (proximal = `prepare`'s logprobs, or this forward detached when
        there is one update per batch), minus the entropy bonus, plus the KL to the
        reference policy when it is in the loss."""
        lc = self.cfg.trainer.loss
        logp, entropy = output
        f = {k: v[:, 1:] for k, v in mb.fields.items()}
        mask = f["loss_mask"]
        opts = policy_loss_options(self.cfg)
        norm: dict[str, Any] = dict(num_tokens=batch.global_num_tokens, num_seqs=batch.global_num_seqs)
        norm["norm_tokens"] = opts.pop("norm_tokens")
        prox = f.get("proximal_logprobs", logp.detach())
        loss, m = ppo_policy_loss(logp, prox, f["behaviour_logprobs"], f["advantages"], mask, **opts, **norm)
        if lc.entropy_coef > 0:
            loss = loss - lc.entropy_coef * aggregate(entropy, mask, lc.agg, **norm)
        if self.kl_in_loss:
            kl = self._kl_to_reference(mb, logp)
            loss = loss + self.kl_ctl.value * aggregate(kl, mask, lc.agg, **norm)
            m["kl_ref"] = _masked_mean(kl.detach(), mask)
        if self.routing is not None:
            loss = loss + self._routing_terms(mask, batch, m)
        m.update(loss=float(loss.detach()), entropy=_masked_mean(entropy.detach(), mask), tokens=float(mask.sum()))
        return loss, m

    def _routing_terms(self, mask: torch.Tensor, batch: TrainBatch, m: dict[str, float]) -> torch.Tensor:
        assert self.routing is not None
        coef = self.cfg.trainer.loss.router_aux_coef
        return routing_loss_term(self.routing.stats(), coef, mask.sum(), batch.global_num_tokens, m)

    def after_step(self, batch: TrainBatch, metrics: dict[str, float]) -> None:
        """The KL controller sees the step's KL to the reference policy; an MoE policy's
        routing counts become fractions of the rows the rollout reported (`router_disagree`,
        `routing_mismatch`), and `routed_tokens` their number."""
        if self.routing is not None:
            self.routing.clear()
            routing_fractions(metrics)
        if self.kl_in_loss:
            self.kl_ctl.update(metrics.get("kl_ref", 0.0), batch.global_num_seqs)
            metrics["kl_coef"] = self.kl_ctl.value

    def _kl_to_reference(self, mb: MicroBatch, logp: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.ref_model is not None:
                ref_logp = token_stats(self.ref_model, mb, entropy_grad=False)[0]
            else:
                with self.model.disable_adapter():  # type: ignore[operator]
                    ref_logp = token_stats(self.model, mb, entropy_grad=False)[0]
        return kl_penalty(logp, ref_logp, self.cfg.algorithm.kl.estimator)

    def export_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by HF name in `dtype`, on the engine's device: gathered and cast
        there, never copied to the CPU (a collective: every rank iterates to the end).
        With LoRA, only the adapter tensors, by PEFT's saved names (roles/weights/lora_adapters.py)."""
        self.restore_params()
        if not self.lora:
            for name, tensor in full_state_dict_items(self.model, on_mesh_device=True):
                yield from checkpoint_items(name, tensor.detach().to(dtype))
            return
        for name, tensor in full_state_dict_items(self.model, keep=is_adapter, on_mesh_device=True):
            yield peft_name(name), tensor.detach().to(dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))
