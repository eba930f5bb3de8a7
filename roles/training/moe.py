"""Mixture-of-experts models in the trainer: routing replay (R3), the routers' agreement
with the rollout, the load-balancing loss, and expert weights by their checkpoint names.

HF's Qwen3-MoE and Qwen2-MoE route each token in a `*TopKRouter` module (a layer's
`mlp.gate`): a linear map to one logit per expert, a softmax, the top k, renormalised when
`norm_topk_prob`. `MoeRouting(model)` puts a forward of its own on every router; within
`routing.micro_batch(...)` that forward

* for each row (token) whose rollout experts are given (`mask` 1), routes it to exactly
  those experts when `replay` is on; the gate weights are the trainer's own softmax taken at
  those experts (renormalised like the model's), so the router's weights and the replayed
  experts' weights get their gradients as in an ordinary forward;
* routes every other row itself (prompt rows the engine did not report, padding);
* counts, over the rows with given experts, those whose own top-k set differs from the given
  set in any layer (`disagree`: the reason to replay, measured with and without it) and those
  whose experts *used* differ (`mismatch`: 0 whenever replay is on);
* keeps the load-balancing loss of the rows `valid` marks (Switch Transformer's, as HF's
  `load_balancing_loss_func`: experts x sum over experts of the fraction of routed slots times
  the mean router probability, averaged over layers; `top_k` when perfectly balanced).

Outside `micro_batch` the routers behave exactly as HF's. The choice itself is
`RoutingReplay.select` (logits in, gate weights and experts out), which the Megatron engine
puts on megatron-core's routers too (roles/megatron/moe.py); `routing_loss_term` and
`routing_fractions` turn the figures into the loss term and the step's metrics for either engine.
A layer's statistics are taken at its first call within a micro-batch, so a
gradient-checkpointing recompute counts nothing twice and replays the same experts.

`checkpoint_items` turns the fused expert tensors transformers holds in memory
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) into the per-expert
tensors of HF checkpoints (`experts.{e}.gate_proj.weight` ...), which transformers and
vLLM both load: views, no copies.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of an HF MoE model, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def is_moe(model: nn.Module) -> bool:
    return bool(find_routers(model))


@dataclass
class RoutingStats:
    """One micro-batch's routing figures (tensors on the model's device, no gradient but
    `aux_loss`)."""

    compared: Tensor  # rows with rollout experts
    disagree: Tensor  # of those, rows whose own top-k differs in some layer
    mismatch: Tensor  # of those, rows whose experts used differ in some layer
    aux_loss: Tensor  # load-balancing loss (with its graph), mean over layers


@dataclass
class _Plan:
    experts: Tensor | None  # int64 [N, L, k]
    mask: Tensor | None  # bool [N]
    valid: Tensor | None  # bool [N]: rows that are real tokens (None: all)
    replay: bool
    seen: set[int] = field(default_factory=set)
    disagree: Tensor | None = None  # bool [N]
    mismatch: Tensor | None = None  # bool [N]
    aux: list[Tensor] = field(default_factory=list)


class RoutingReplay:
    """Routing replay and routing statistics for `num_layers` top-k softmax routers, whatever
    modules hold them: `select` is one router's choice from its logits, and `plan` / `stats` /
    `micro_batch` say what the next forwards replay and measure (see the module docstring).
    `MoeRouting` puts it on HF's routers, `roles/megatron/moe.py` on megatron-core's."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.num_experts = num_experts
        self._plan: _Plan | None = None

    def plan(
        self,
        experts: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        replay: bool = False,
        valid: Tensor | None = None,
    ) -> None:
        """Route the forwards from now on (and their recomputes in backward) by `experts`
        (int [N, L, k], N = the rows the model sees: batch x sequence flattened) on the rows
        `mask` marks, when `replay`; measure against them either way. Holds until the next
        `plan` or `clear`, so a micro-batch's backward recomputes what its forward did."""
        if experts is not None and tuple(experts.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(
                f"routed experts of shape {tuple(experts.shape)}: the model has {self.num_layers} MoE layers "
                f"of top-{self.top_k}"
            )
        self._plan = _Plan(
            experts=None if experts is None else experts.long(),
            mask=None if mask is None else mask.bool(),
            valid=None if valid is None else valid.bool(),
            replay=replay and experts is not None,
        )

    def stats(self) -> RoutingStats:
        """The figures of the forward since the last `plan` (zeros without one)."""
        return _stats(self._plan or _Plan(None, None, None, False))

    def clear(self) -> None:
        """Back to the model's own routing, measuring nothing."""
        self._plan = None

    @contextlib.contextmanager
    def micro_batch(
        self,
        experts: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        replay: bool = False,
        valid: Tensor | None = None,
    ) -> Iterator[list[RoutingStats]]:
        """`plan` for the block (forward and backward inside it); yields a list that holds
        the block's `RoutingStats` once it ends, and `clear`s."""
        out: list[RoutingStats] = []
        self.plan(experts, mask, replay=replay, valid=valid)
        try:
            yield out
        finally:
            out.append(self.stats())
            self.clear()

    def select(self, layer: int, logits: Tensor, *, normalize: bool) -> tuple[Tensor, Tensor]:
        """(gate weights float32 [N, k], experts [N, k]) of router `layer` from its logits
        [N, experts]: softmax, then the top k or, on the rows the plan replays, the given
        experts; the weights are the softmax at the chosen experts (renormalised when
        `normalize`: HF's `norm_topk_prob`)."""
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        own = torch.topk(probs, self.top_k, dim=-1).indices
        plan = self._plan
        chosen = own
        given = _given(plan, layer, own)
        if plan is not None and given is not None:
            chosen = torch.where(plan.mask[:, None], given, own) if plan.replay else own  # type: ignore[index]
            if layer not in plan.seen:
                with torch.no_grad():
                    plan.disagree = _or(plan.disagree, _differs(own, given) & plan.mask)  # type: ignore[operator]
                    plan.mismatch = _or(plan.mismatch, _differs(chosen, given) & plan.mask)  # type: ignore[operator]
        weights = probs.gather(-1, chosen)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if plan is not None:
            # Computed on every forward, kept from the first: activation recompute in backward
            # must save the same tensors as the forward did (torch.utils.checkpoint checks).
            aux = _balance_loss(probs, chosen, self.num_experts, plan.valid)
            if layer not in plan.seen:
                plan.aux.append(aux)
                plan.seen.add(layer)
        return weights, chosen


class MoeRouting(RoutingReplay):
    """Routing replay and routing statistics for every router of `model` (see the module
    docstring). `model` must be an HF MoE model (`is_moe`)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no top-k routers: not a mixture of experts")
        first: Any = self.routers[0]
        super().__init__(len(self.routers), int(first.top_k), int(first.num_experts))
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(_routed_forward(self, layer), router)

    def route(self, layer: int, router: Any, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(logits, gate weights, experts) of one router (an HF `*TopKRouter`), as it returns them."""
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        weights, chosen = self.select(layer, logits, normalize=router.norm_topk_prob)
        return logits, weights.to(logits.dtype), chosen


def routing_loss_term(
    stats: RoutingStats, coef: float, tokens: Tensor, global_tokens: int, m: dict[str, float]
) -> Tensor:
    """One micro-batch's share of the load-balancing loss (`coef` times the loss, weighted by
    the micro-batch's `tokens` over the step's `global_tokens`, like the policy loss; a zero
    with the graph when `coef` is 0), and its routing counts into `m` (MOE_METRICS' names,
    roles/training/metrics.py)."""
    m.update(
        router_aux_loss=float(stats.aux_loss.detach()),
        routed_rows=float(stats.compared),
        router_disagree_rows=float(stats.disagree),
        routing_mismatch_rows=float(stats.mismatch),
    )
    if coef > 0:
        return coef * stats.aux_loss * (tokens / max(global_tokens, 1))
    return stats.aux_loss * 0.0


def routing_fractions(metrics: dict[str, float]) -> None:
    """A step's summed routing counts into what it reports: `router_disagree` and
    `routing_mismatch` as fractions of the `routed_tokens` (the rows the rollout reported),
    none of them when there were none."""
    rows = metrics.pop("routed_rows", 0.0)
    disagree, mismatch = metrics.pop("router_disagree_rows", 0.0), metrics.pop("routing_mismatch_rows", 0.0)
    if rows > 0:
        metrics.update(routed_tokens=rows, router_disagree=disagree / rows, routing_mismatch=mismatch / rows)


def _routed_forward(routing: MoeRouting, layer: int) -> Callable[[nn.Module, Tensor], tuple[Tensor, Tensor, Tensor]]:
    def forward(router: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return routing.route(layer, router, hidden_states)

    return forward


def _given(plan: _Plan | None, layer: int, own: Tensor) -> Tensor | None:
    if plan is None or plan.experts is None:
        return None
    given = plan.experts[:, layer].to(own.device)
    if given.shape != own.shape:
        raise ValueError(f"routed experts for {given.shape[0]} rows, the model routes {own.shape[0]}")
    if plan.mask is not None:
        plan.mask = plan.mask.to(own.device)
    else:
        plan.mask = torch.ones(own.shape[0], dtype=torch.bool, device=own.device)
    return given


def _differs(a: Tensor, b: Tensor) -> Tensor:
    """bool [N]: the rows whose expert sets differ (order within the top k ignored)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def _or(acc: Tensor | None, new: Tensor) -> Tensor:
    return new if acc is None else acc | new


def _balance_loss(probs: Tensor, chosen: Tensor, num_experts: int, valid: Tensor | None) -> Tensor:
    """Switch Transformer's load-balancing loss of one layer over the `valid` rows."""
    if valid is not None:
        valid = valid.to(probs.device)
        probs, chosen = probs[valid], chosen[valid]
    rows = max(int(probs.shape[0]), 1)
    with torch.no_grad():
        slots = torch.bincount(chosen.reshape(-1), minlength=num_experts).float() / rows
    return num_experts * (slots * probs.sum(dim=0) / rows).sum()


def model_is_moe(model_path: Path) -> bool:
    """Whether the HF model directory holds a mixture of experts (`num_experts` > 0 in its
    config.json), read without loading it."""
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def _stats(plan: _Plan) -> RoutingStats:
    device = plan.aux[0].device if plan.aux else torch.device("cpu")
    zero = torch.zeros((), device=device)
    compared = plan.mask.sum() if plan.mask is not None and plan.experts is not None else zero
    return RoutingStats(
        compared=compared.float(),
        disagree=plan.disagree.sum().float() if plan.disagree is not None else zero,
        mismatch=plan.mismatch.sum().float() if plan.mismatch is not None else zero,
        aux_loss=torch.stack(plan.aux).mean() if plan.aux else zero,
    )


# --- expert weights by checkpoint name --------------------------------------------------

_FUSED_GATE_UP = ".experts.gate_up_proj"
_FUSED_DOWN = ".experts.down_proj"


def checkpoint_items(name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """`(name, tensor)` as HF checkpoints name it: a fused expert tensor becomes one tensor
    per expert (views), anything else passes as it is."""
    if name.endswith(_FUSED_GATE_UP) and tensor.dim() == 3:
        prefix = name[: -len("gate_up_proj")]
        width = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{prefix}{e}.gate_proj.weight", tensor[e, :width]
            yield f"{prefix}{e}.up_proj.weight", tensor[e, width:]
    elif name.endswith(_FUSED_DOWN) and tensor.dim() == 3:
        prefix = name[: -len("down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{prefix}{e}.down_proj.weight", tensor[e]
    else:
        yield name, tensor
