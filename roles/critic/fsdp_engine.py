"""The FSDP2 value model: the policy's architecture with a scalar head per token.

Alignment (what the controller relies on): in the packed layout of a `ValueRequest`,
position j of the returned values holds V(state before token j), i.e. the head's output
at position j-1 (0 at the first position of each sequence) — the same alignment as the
trainer's token logprobs. The value head starts at zero. When `algorithm.kl.use` is
`reward`, the critic also holds the frozen reference policy (the actor's initial weights)
and returns its token logprobs with the values, so the controller can fold the KL
penalty into token rewards before GAE.
"""

from __future__ import annotations

from pathlib import Path

import torch

from roles.algo import token_logprobs
from roles.critic.value_rows import as_batch, clipped_value_loss, sequence_spans, unpad_rows
from roles.fsdp.engine_base import FSDPEngineBase
from roles.fsdp.wrap import wrap_model_with_fsdp
from roles.training.hf_loading import DTYPES, load_causal_lm
from roles.training.metrics import CRITIC_METRICS
from roles.training.microbatch import MicroBatch
from runtime.config import RunConfig
from transport.wire import TrainBatch, ValueRequest


class CriticEngine(FSDPEngineBase):
    """`train_step` (the base's) takes `critic.epochs × critic.mini_batches` optimizer steps
    on each batch, values clipped around the old ones (which the controller sends, so no
    extra forward is needed); `values` scores packed sequences."""

    metric_names = CRITIC_METRICS

    def __init__(self, cfg: RunConfig, actor_path: Path) -> None:
        from transformers import AutoConfig, AutoModelForTokenClassification

        c = cfg.critic
        super().__init__(cfg, micro_batch_tokens=c.micro_batch_tokens, epochs=c.epochs, mini_batches=c.mini_batches)
        path = Path(cfg.critic.model_path) if cfg.critic.model_path else actor_path
        dtype = DTYPES[cfg.fsdp.param_dtype]
        config = AutoConfig.from_pretrained(str(path), num_labels=1)
        config.classifier_dropout = 0.0  # values must not be noisy between scoring and training
        model = AutoModelForTokenClassification.from_pretrained(
            str(path), config=config, dtype=dtype, attn_implementation="sdpa"
        )
        torch.nn.init.zeros_(model.score.weight)
        if model.score.bias is not None:
            torch.nn.init.zeros_(model.score.bias)
        self.model = wrap_model_with_fsdp(model.to(self.device), cfg.fsdp, device=self.device)
        self.ref_model = None
        if cfg.algorithm.kl.enabled and cfg.algorithm.kl.use == "reward":
            ref = load_causal_lm(actor_path, dtype, self.device).eval().requires_grad_(False)
            self.ref_model = wrap_model_with_fsdp(ref, cfg.fsdp, device=self.device)
        self._setup_optimizer(cfg.critic.optim)

    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Per-token values, position j holding the head's output at j-1 (0 at the first)."""
        out = model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT, use_cache=False)
        out = out.logits[..., 0].float()
        return torch.nn.functional.pad(out[:, :-1], (1, 0))  # position j <- output at j-1

    @torch.no_grad()
    def values(self, req: ValueRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token values (and reference logprobs) of the packed sequences of `req`."""
        self.model.eval()
        batch = as_batch(req)
        values = torch.zeros(req.input_ids.numel(), dtype=torch.float32)
        ref = torch.zeros_like(values) if self.ref_model is not None else None
        spans = sequence_spans(req.cu_seqlens)
        row = 0
        for mb in self.micro_batches(batch, self.micro_batch_tokens):
            mb = mb.to(self.device)
            v = self.forward(self.model, mb).cpu()
            if ref is not None:
                unpad_rows(self._ref_logprobs(mb), spans, row, ref)
            row = unpad_rows(v, spans, row, values)
        return values, ref

    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        assert self.ref_model is not None
        ids = mb.input_ids_BT
        logp = token_logprobs(
            self.ref_model(input_ids=ids, attention_mask=mb.attention_mask_BT, use_cache=False).logits[:, :-1],
            ids[:, 1:],
        )
        return torch.nn.functional.pad(logp, (1, 0)).cpu()

    def loss(self, mb: MicroBatch, batch: TrainBatch, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped value loss against the returns."""
        return clipped_value_loss(mb, batch, values, self.cfg.critic.value_clip)
