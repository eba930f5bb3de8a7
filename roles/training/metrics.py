"""Metrics of a training step: folded over micro-batches, then reduced over ranks.

A micro-batch reports python floats and "tokens", its masked token count. `MetricNames`
says how each name combines: `summed` names add up (losses already normalised by the
step's global count), `weighted` names are token-weighted means, `maxed` names take the
maximum. Every rank of the default group must reduce the same `MetricNames`, so the
engine kinds' names live here, where all engines import them from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MetricNames:
    summed: tuple[str, ...] = ()
    weighted: tuple[str, ...] = ()
    maxed: tuple[str, ...] = ()

    def all(self) -> tuple[str, ...]:
        """The accumulator keys: "tokens", then every name, in a fixed order."""
        return ("tokens", *self.summed, *self.weighted, *self.maxed)

    def plus(self, other: MetricNames) -> MetricNames:
        """These names, then `other`'s, group by group."""
        return MetricNames(self.summed + other.summed, self.weighted + other.weighted, self.maxed + other.maxed)

    def without(self, *names: str) -> MetricNames:
        """These names less `names`, order kept."""
        groups = (self.summed, self.weighted, self.maxed)
        return MetricNames(*(tuple(k for k in group if k not in names) for group in groups))


# The decoupled-PPO actor (FSDP and Megatron engines); kl_ref only with a reference policy.
ACTOR_METRICS = MetricNames(
    summed=("loss",),
    weighted=(
        "clip_fraction",
        "kl_behaviour_proximal",
        "entropy",
        "importance_weight_mean",
        "truncated_fraction",
        "masked_fraction",
        "behaviour_proximal_abs_diff",
        "dual_clip_fraction",
        "kl_ref",
    ),
    maxed=("importance_weight_max", "ratio_max"),
)
# A mixture-of-experts actor adds these (roles/training/moe.py): the rows with the rollout's
# routing and how many of them the trainer's router disagrees with (`router_disagree_rows`) or
# was routed differently (`routing_mismatch_rows`, 0 under replay), summed to fractions after
# the step; the load-balancing loss token-weighted.
MOE_METRICS = MetricNames(
    summed=("routed_rows", "router_disagree_rows", "routing_mismatch_rows"), weighted=("router_aux_loss",)
)
CRITIC_METRICS = MetricNames(summed=("value_loss",), weighted=("value_clip_fraction", "value_mean"))


def accumulate(acc: dict[str, float], m: dict[str, float], names: MetricNames) -> None:
    """Fold one micro-batch's metrics (`m["tokens"]` its masked token count) into `acc`."""
    tokens = m["tokens"]
    acc["tokens"] = acc.get("tokens", 0.0) + tokens
    for k in names.summed:
        acc[k] = acc.get(k, 0.0) + m.get(k, 0.0)
    for k in names.weighted:
        if k in m:
            acc[k] = acc.get(k, 0.0) + m[k] * tokens
    for k in names.maxed:
        if k in m:
            acc[k] = max(acc.get(k, 0.0), m[k])


def reduce_metrics(acc: dict[str, float], names: MetricNames, device: torch.device) -> dict[str, float]:
    """Over all ranks of the default group: sum `summed`, token-weight-average `weighted`
    (`acc` holds value * tokens and "tokens"), max `maxed`. A collective; a weighted name
    missing from `acc` is left out, so every rank must hold the same weighted names."""
    summed = ["tokens", *names.summed, *[k for k in names.weighted if k in acc]]
    sums = torch.tensor([acc.get(k, 0.0) for k in summed], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    maxes = torch.tensor([acc.get(k, 0.0) for k in names.maxed], dtype=torch.float64, device=device)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    out = dict(zip(summed, sums.tolist(), strict=True))
    tokens = max(out.pop("tokens"), 1.0)
    for k in names.weighted:
        if k in out:
            out[k] /= tokens
    out.update(zip(names.maxed, maxes.tolist(), strict=True))
    return out


def mean_over_steps(steps: list[dict[str, float]], names: MetricNames) -> dict[str, float]:
    """Metrics of several optimizer steps of one training step: the mean of each name over
    the steps that report it, the max for `maxed` names, the last `lr`, and
    `optimizer_steps`. Every rank holds the same reduced values, so this is no collective."""
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for m in steps for k in m)
    for k in keys:
        values = [m[k] for m in steps if k in m]
        out[k] = max(values) if k in names.maxed else sum(values) / len(values)
    if steps and "lr" in steps[-1]:
        out["lr"] = steps[-1]["lr"]
    out["optimizer_steps"] = float(len(steps))
    return out
