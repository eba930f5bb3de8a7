"""The value model on Megatron-core (`critic.backend=megatron`): the policy's GPTModel with
its output layer replaced by a scalar head (`roles/megatron/model.py`), trained
with the FSDP critic's clipped value loss and reporting its metrics.

Same contract as `roles/critic/fsdp_engine.py`: position j of the returned values holds
V(state before token j) (the head's output at j-1, 0 at each sequence's first position),
the head starts at zero, and with `algorithm.kl.use=reward` the engine also holds the
frozen reference policy (the actor's initial weights, a second GPTModel) and returns its
token logprobs. Tensor parallelism: the ranks of one replica gather their shards, compute
the same values, and each answers with its own shard. Pipeline parallelism is refused by
the config check (`critic.megatron.pipeline_model_parallel_size` must be 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from roles.critic.value_rows import as_batch, clipped_value_loss, sequence_spans, unpad_rows
from roles.megatron.convert import ModelDims, check_divisible
from roles.megatron.engine_base import MegatronEngineBase, gather_shards
from roles.megatron.model import (
    VALUE_HEAD,
    build_actor,
    build_value_model,
    load_hf_weights,
    next_token_logprobs,
    transformer_config,
)
from roles.training.metrics import CRITIC_METRICS
from roles.training.microbatch import MicroBatch
from runtime.config import RunConfig
from transport.wire import TrainBatch, ValueRequest


class MegatronCriticEngine(MegatronEngineBase):
    """`train_step` (the base's) takes `critic.epochs × critic.mini_batches` optimizer steps
    per batch: the clipped value loss against the returns, metrics as the FSDP critic's
    (value_loss, value_clip_fraction, value_mean, grad_norm, lr, ...). `values` scores
    packed sequences. `version` counts trained batches."""

    metric_names = CRITIC_METRICS

    def __init__(self, cfg: RunConfig, actor_path: Path) -> None:
        from transformers import AutoConfig

        c = cfg.critic
        super().__init__(
            cfg, c.megatron, micro_batch_tokens=c.micro_batch_tokens, epochs=c.epochs, mini_batches=c.mini_batches
        )
        path = Path(cfg.critic.model_path) if cfg.critic.model_path else actor_path
        self.dims = ModelDims.from_hf_config(AutoConfig.from_pretrained(str(path)))
        check_divisible(self.dims, self.tp, "critic.megatron")
        config = transformer_config(
            self.dims, tp=self.tp, pp=self.pp, dtype=self.dtype, recompute=cfg.trainer.gradient_checkpointing
        )
        self.critic = build_value_model(self.dims, config, self.device)
        load_hf_weights(self.critic, path, self.dims, skip=VALUE_HEAD)
        self._wrap(self.critic, config, cfg.critic.optim)
        self.ref_model: torch.nn.Module | None = None
        if cfg.algorithm.kl.enabled and cfg.algorithm.kl.use == "reward":
            ref_dims = ModelDims.from_hf_config(AutoConfig.from_pretrained(str(actor_path)))
            ref_config = transformer_config(ref_dims, tp=self.tp, pp=self.pp, dtype=self.dtype, recompute=False)
            ref = build_actor(ref_dims, ref_config, self.device)
            load_hf_weights(ref, actor_path, ref_dims)
            self.ref_model = ref.eval().requires_grad_(False)

    # --- values ------------------------------------------------------------------------
    @torch.no_grad()
    def values(self, req: ValueRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token values (and reference logprobs) of this rank's packed sequences of `req`."""
        mine = as_batch(req)
        batch = gather_shards(mine, self.replica_group, self.device)
        offset = self._own_offset(mine)
        self.model.eval()
        values = torch.zeros(batch.input_ids.numel(), dtype=torch.float32)
        ref = torch.zeros_like(values) if self.ref_model is not None else None
        spans = sequence_spans(batch.cu_seqlens)
        row = 0
        for mb in self._micro_batches(batch, self.micro_batch_tokens):
            v = self.forward(self.model, mb).cpu()
            if ref is not None:
                unpad_rows(self._ref_logprobs(mb), spans, row, ref)
            row = unpad_rows(v, spans, row, values)
        n = mine.input_ids.numel()
        return values[offset : offset + n], None if ref is None else ref[offset : offset + n]

    def _own_offset(self, mine: TrainBatch) -> int:
        """Where this rank's tokens start in its replica's gathered batch (group-rank order)."""
        import torch.distributed as dist

        size = dist.get_world_size(self.replica_group)
        if size == 1:
            return 0
        count = torch.tensor([mine.input_ids.numel()], dtype=torch.int64, device=self.device)
        counts = [torch.empty_like(count) for _ in range(size)]
        dist.all_gather(counts, count, group=self.replica_group)
        me = dist.get_rank(self.replica_group)
        return int(sum(int(c) for c in counts[:me]))

    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Per-token values, position j holding the head's output at j-1 (0 at the first)."""
        out = model(mb.input_ids_BT, mb.attention_mask_BT)["values"]
        return torch.nn.functional.pad(out[:, :-1], (1, 0))  # position j <- output at j-1

    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        assert self.ref_model is not None
        logits = self.ref_model(mb.input_ids_BT, mb.attention_mask_BT)["logits"]
        return torch.nn.functional.pad(next_token_logprobs(logits, mb.input_ids_BT), (1, 0)).cpu()

    # --- training ----------------------------------------------------------------------
    def loss(self, mb: MicroBatch, batch: TrainBatch, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped value loss against the returns."""
        return clipped_value_loss(mb, batch, values, self.cfg.critic.value_clip)
