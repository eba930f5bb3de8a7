"""Routing of a megatron-core mixture of experts as HF's Qwen3-MoE routes, with routing replay.

`MegatronMoeRouting(model, normalize=...)` puts a forward of its own on every megatron
`TopKRouter` of `model`: the logits are the router's linear map of the hidden states, and the
choice of experts, the gate weights, the replay of given experts and the routing statistics
are `RoutingReplay.select`'s (roles/training/moe.py), the same code the FSDP2 actor's HF
routers run. So a token goes to the same experts with the same gate weights as in
transformers (softmax over every expert, top k, renormalised when `normalize`), a replayed
token to exactly its given experts, and `plan` / `stats` / `micro_batch` mean what they mean
there. The router returns what megatron's MoE layer takes: the gate weights scattered into
`[N, experts]` probabilities and the `[N, experts]` routing map.

Megatron's hidden states are sequence-first (`[T, B, H]`), so its router sees the rows of a
`[B, T]` micro-batch in `T x B` order: `sequence_first` reorders per-row tensors given in the
model input's `B x T` order (MicroBatch.routing) to match.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roles.training.moe import RoutingReplay


def find_megatron_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of a megatron-core model, in layer order (empty for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class MegatronMoeRouting(RoutingReplay):
    """HF-equivalent routing, replay and statistics on every megatron `TopKRouter` of
    `model` (see the module docstring). `normalize`: HF's `norm_topk_prob`."""

    def __init__(self, model: nn.Module, *, normalize: bool) -> None:
        self.routers = find_megatron_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no top-k routers: not a mixture of experts")
        first: Any = self.routers[0]
        super().__init__(len(self.routers), int(first.topk), int(first.num_experts))
        self.normalize = normalize
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(_routed_forward(self, layer), router)

    def route(self, layer: int, router: Any, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(probabilities [N, experts], routing map [N, experts] bool) of one router for
        `hidden` [T, B, H]: the gate weights at the chosen experts, zero elsewhere."""
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight)
        weights, chosen = self.select(layer, logits, normalize=self.normalize)
        probs = torch.zeros_like(logits).scatter(1, chosen, weights.to(logits.dtype))
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
        return probs, routing_map


def _routed_forward(routing: MegatronMoeRouting, layer: int) -> Callable[..., tuple[Tensor, Tensor]]:
    def forward(router: nn.Module, input: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        del padding_mask  # the load-balancing loss takes its valid rows from the plan
        return routing.route(layer, router, input)

    return forward


def sequence_first(rows: Tensor, batch: int, length: int) -> Tensor:
    """Per-row values of a `[batch, length]` micro-batch (rows in `batch x length` order,
    any trailing dims) reordered to megatron's `length x batch` order."""
    return rows.reshape(batch, length, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)
