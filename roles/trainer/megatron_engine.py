"""The Megatron-core actor engine: decoupled PPO on a tensor- and pipeline-parallel GPTModel.

The shared machinery (parallel state, DDP, optimizer, schedule, checkpoints) is
`roles/megatron/engine_base.py`; this file is the actor's model and loss.

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

Mixture of experts (a Qwen3-MoE `model.path`, TP = PP = 1): the GPTModel's routers route as
transformers' do (`roles/megatron/moe.py`); with `algorithm.routing_replay: rollout` every token
the rollout reported is trained on the experts vLLM routed it to; the load-balancing loss
(`router_aux_loss`) is reported and added with `trainer.loss.router_aux_coef`, and the
routing figures (`router_disagree`, `routing_mismatch`) are the FSDP2 actor's.

Weights. The model is built from the HF directory's config and loaded from its safetensors
(`roles/megatron/convert.py` documents the mapping); `export_weights` yields HF
names and full tensors on the first pipeline stage. Megatron's mixed-precision optimizer
keeps fp32 master weights when the params are bf16. Checkpoints are per rank and resume
only with the same TP / PP / world size (`roles/megatron/checkpoint.py`). All
methods are blocking collectives, called from one thread, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from roles.algo import ppo_policy_loss
from roles.megatron.convert import ModelDims, check_divisible
from roles.megatron.engine_base import MegatronEngineBase, gather_shards
from roles.megatron.model import (
    export_hf_weights,
    load_hf_weights,
    make_actor,
    next_token_logprobs,
    transformer_config,
    vocab_parallel_entropy,
)
from roles.megatron.moe import MegatronMoeRouting, sequence_first
from roles.trainer.policy_loss import policy_loss_options
from roles.training.metrics import ACTOR_METRICS, MOE_METRICS
from roles.training.microbatch import MicroBatch
from roles.training.moe import routing_fractions, routing_loss_term
from runtime.config import RunConfig
from transport.wire import TrainBatch

# The FSDP actor's metrics less kl_ref (no reference policy here). Every rank reduces every
# key, so ranks that do not report (not last stage, or TP rank > 0) send zeros.
METRICS = ACTOR_METRICS.without("kl_ref")


class MegatronEngine(MegatronEngineBase):
    """`train_step` (the base's) takes `trainer.ppo_epochs × trainer.mini_batches` optimizer
    steps per batch, the ratio against this forward when both are 1 (as the FSDP engine)."""

    metric_names = METRICS

    def __init__(self, cfg: RunConfig, model_path: Path) -> None:
        from transformers import AutoConfig

        t = cfg.trainer
        m = t.megatron
        super().__init__(
            cfg, m, micro_batch_tokens=t.micro_batch_tokens, epochs=t.ppo_epochs, mini_batches=t.mini_batches
        )
        hf_config = AutoConfig.from_pretrained(str(model_path))
        self.dims = ModelDims.from_hf_config(hf_config)
        check_divisible(self.dims, self.tp, "trainer.megatron")
        if self.dims.experts and self.pp > 1:
            raise ValueError(
                f"trainer.megatron.pipeline_model_parallel_size={self.pp}: a mixture-of-experts policy trains with PP=1"
            )
        config = transformer_config(
            self.dims, tp=self.tp, pp=self.pp, dtype=self.dtype, recompute=cfg.trainer.gradient_checkpointing
        )
        self.actor = make_actor(m.model_provider, hf_config, config, self.dims, self.device)
        load_hf_weights(self.actor, model_path, self.dims)
        self.routing = MegatronMoeRouting(self.actor, normalize=self.dims.norm_topk) if self.dims.experts else None
        if self.routing is not None:
            self.metric_names = METRICS.plus(MOE_METRICS)  # type: ignore[misc]  # all ranks load one model
        self._wrap(self.actor, config, cfg.trainer.optim)

    # --- training ----------------------------------------------------------------------
    def prepare(self, batch: TrainBatch) -> TrainBatch:
        """`batch` with `proximal_logprobs` from one forward-only pass before the first
        update. Only the last pipeline stage computes the loss, so only it fills them in;
        the other stages carry zeros they never read."""
        prox = torch.zeros(batch.input_ids.numel(), dtype=torch.float32)
        cu = batch.cu_seqlens.tolist()
        for i, row in enumerate(self._sequence_logprobs(batch)):
            prox[cu[i] + 1 : cu[i + 1]] = row
        return msgspec.structs.replace(batch, proximal_logprobs=prox)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """The base's step; an MoE policy's routing counts become the fractions it reports."""
        metrics = super().train_step(batch)
        if self.routing is not None:
            self.routing.clear()
            routing_fractions(metrics)
        return metrics

    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """The stage's output; on the last stage the vocabulary-parallel logits. An MoE policy
        routes as `_plan_routing` says."""
        self._plan_routing(mb)
        return model(mb.input_ids_BT, mb.attention_mask_BT)["logits"]  # type: ignore[no-any-return]

    def _plan_routing(self, mb: MicroBatch) -> None:
        """An MoE policy's routing for `mb` (on the device, in megatron's sequence-first row
        order): the rollout's experts where it reported them, replayed when
        `algorithm.routing_replay` is `rollout`, measured always; the load-balancing loss
        over the real tokens."""
        if self.routing is None:
            return
        B, T = mb.input_ids_BT.shape
        valid = sequence_first(mb.attention_mask_BT.flatten().bool(), B, T)
        experts, mask = (sequence_first(t, B, T) for t in mb.routing) if mb.routing is not None else (None, None)
        replay = self.cfg.algorithm.routing_replay == "rollout"
        self.routing.plan(experts, mask, replay=replay, valid=valid)

    def loss(self, mb: MicroBatch, batch: TrainBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Decoupled PPO (proximal = `prepare`'s logprobs, or this forward detached when
        there is one update per batch), plus an MoE policy's load-balancing loss; entropy is
        reported, not in the loss."""
        with torch.no_grad():
            entropy = vocab_parallel_entropy(logits[:, :-1])
        logp = next_token_logprobs(logits, mb.input_ids_BT)
        f = {k: v[:, 1:] for k, v in mb.fields.items()}
        mask = f["loss_mask"]
        prox = f.get("proximal_logprobs", logp.detach())
        loss, m = ppo_policy_loss(
            logp,
            prox,
            f["behaviour_logprobs"],
            f["advantages"],
            mask,
            **policy_loss_options(self.cfg),
            num_tokens=batch.global_num_tokens,
            num_seqs=batch.global_num_seqs,
        )
        if self.routing is not None:
            coef = self.cfg.trainer.loss.router_aux_coef
            loss = loss + routing_loss_term(self.routing.stats(), coef, mask.sum(), batch.global_num_tokens, m)
        tokens = float(mask.sum())
        m.update(loss=float(loss.detach()), entropy=float((entropy * mask).sum()) / max(tokens, 1.0), tokens=tokens)
        return loss, m

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
        mbs = self._micro_batches(batch, self.micro_batch_tokens)
        self.model.eval()
        outputs = self._run_schedule(mbs, self._logprobs_step, forward_only=True)
        return [row for out in outputs for row in out["logprobs"]][: batch.cu_seqlens.numel() - 1]

    def _logprobs_step(self, data: Iterator[MicroBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        mb = next(data)
        logits = self.forward(model, mb)

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
