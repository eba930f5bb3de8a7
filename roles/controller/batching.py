"""Training batches from rewarded groups: advantages, packing, and sharding over ranks.

`build_train_batches` returns one `TrainBatch` per trainer rank. Sequences are packed
(prompt then response, `cu_seqlens` offsets); per-token tensors are 0 on prompt
positions, and `loss_mask` is 0 on the tokens a multi-turn environment inserted too
(`global_num_tokens` counts only sampled tokens). Shards are balanced by token count
(longest first, to the lightest rank).
`global_num_tokens` / `global_num_seqs` count the whole step, so each rank can
normalise its loss to the global mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roles.algo import compute_advantages
from roles.algo.distill import combine_advantages, distill_advantages
from roles.controller.groups import Group, SampleRec
from transport.wire import TrainBatch


@dataclass(frozen=True)
class Distill:
    """On-policy distillation's part of the advantage (`algorithm.distill`)."""

    coef: float
    mode: str  # "replace" or "add"


@dataclass
class BatchStats:
    num_samples: int
    num_response_tokens: int
    reward_mean: float
    reward_std: float
    response_len_mean: float  # sampled tokens only
    turns_mean: float | None = None  # multi-turn samples: assistant turns per sample
    env_tokens_mean: float | None = None  # multi-turn samples: environment tokens per sample


def sample_advantages(
    groups: list[Group],
    advantage: str,
    norm_by_std: bool,
    *,
    std: str = "unbiased",
    gamma: float = 1.0,
    distill: Distill | None = None,
) -> list[torch.Tensor]:
    """Per-token advantages of every sample, in group then sample order, from
    `compute_advantages` (GAE's were computed by it when the critic's values came, see
    roles/controller/ppo.py, and are read from the samples). A per-sample estimator's
    advantage lies on every response token, environment tokens included (the loss mask
    drops those); "reinforce_pp" sees only the sampled tokens (see `_padded`).
    With `distill`, each sampled token's `-coef * (behaviour logprob - teacher logprob)`
    replaces or is added to it (roles/algo/distill.py); a sample the teacher did not score
    gets no distillation term (its failure is counted as a reward failure)."""
    task = _task_advantages(groups, advantage, norm_by_std, std=std, gamma=gamma)
    if distill is None:
        return task
    samples = [s for g in groups for s in g.ordered()]
    out = []
    for a, s in zip(task, samples, strict=True):
        teacher = s.teacher_logprobs if s.teacher_logprobs is not None else s.logprobs
        d = distill_advantages(s.logprobs, teacher, s.mask(), distill.coef)
        out.append(combine_advantages(a, d, distill.mode))
    return out


def _task_advantages(
    groups: list[Group], advantage: str, norm_by_std: bool, *, std: str, gamma: float
) -> list[torch.Tensor]:
    samples = [s for g in groups for s in g.ordered()]
    if advantage == "gae":
        return [_require(s.advantages, "advantages") for s in samples]
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float32)
    gids = torch.tensor([g.gid for g in groups for _ in g.ordered()], dtype=torch.int64)
    mask_BT, span_BT = _padded(samples)
    adv_BT = compute_advantages(
        advantage, rewards, gids, mask_BT=mask_BT, span_BT=span_BT, norm_by_std=norm_by_std, std=std, gamma=gamma
    )
    return [adv_BT[i, : s.length].clone() for i, s in enumerate(samples)]


def _padded(samples: list[SampleRec]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss mask, response span) as padded [B, T] rows: the loss mask is 0 on environment
    tokens, so REINFORCE++ carries each return across an observation and leaves its tokens
    out of the whitening; the span is 1 on every response token."""
    width = max((s.length for s in samples), default=0)
    mask_BT = torch.zeros(len(samples), width)
    span_BT = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        mask_BT[i, : s.length] = s.mask()
        span_BT[i, : s.length] = 1.0
    return mask_BT, span_BT


def build_train_batches(
    groups: list[Group],
    *,
    step: int,
    advantage: str,
    norm_by_std: bool,
    num_shards: int,
    std: str = "unbiased",
    gamma: float = 1.0,
    distill: Distill | None = None,
) -> tuple[list[TrainBatch], BatchStats]:
    pairs = [(g, s) for g in groups for s in g.ordered()]
    advs = sample_advantages(groups, advantage, norm_by_std, std=std, gamma=gamma, distill=distill)
    lengths = [len(g.prompt.prompt_ids) + s.length for g, s in pairs]
    shards = assign_shards(lengths, num_shards)
    num_tokens = sum(s.num_sampled for _, s in pairs)
    batches = [_pack([pairs[i] for i in idx], [advs[i] for i in idx], step, num_tokens, len(pairs)) for idx in shards]
    for batch, idx in zip(batches, shards, strict=True):
        routed = pack_routed_experts([pairs[i] for i in idx])
        if routed is not None:
            batch.routed_experts, batch.routed_mask = routed
    return batches, _stats(pairs, num_tokens)


def pack_routed_experts(pairs: list[tuple[Group, SampleRec]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(experts [total, layers, top_k], mask uint8 [total]) packed like `input_ids`: each
    sequence's rows as the rollout reported them (prompt first), mask 0 on the rows it did
    not report (the trainer routes those tokens itself). None when no sample carries any."""
    first = next((s.routed_experts for _, s in pairs if s.routed_experts is not None), None)
    if first is None:
        return None
    experts, mask = [], []
    for g, s in pairs:
        length = len(g.prompt.prompt_ids) + s.length
        rows = torch.zeros((length, *first.shape[1:]), dtype=first.dtype)
        seen = torch.zeros(length, dtype=torch.uint8)
        if s.routed_experts is not None and s.routed_experts.shape[1:] == first.shape[1:]:
            n = min(length, s.routed_experts.shape[0])
            rows[:n] = s.routed_experts[:n]
            seen[:n] = 1
        experts.append(rows)
        mask.append(seen)
    return torch.cat(experts), torch.cat(mask)


def assign_shards(lengths: list[int], num_shards: int) -> list[list[int]]:
    """Indices per shard: longest first onto the shard with the fewest tokens so far."""
    loads = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        j = min(range(num_shards), key=lambda k: (loads[k], len(shards[k])))
        shards[j].append(i)
        loads[j] += lengths[i]
    return [sorted(s) for s in shards]


def _pack(
    pairs: list[tuple[Group, SampleRec]], advs: list[torch.Tensor], step: int, num_tokens: int, num_seqs: int
) -> TrainBatch:
    ids, mask, behav, adv, rets, vals = [], [], [], [], [], []
    cu = [0]
    gae = bool(pairs) and pairs[0][1].returns is not None
    for (g, s), a in zip(pairs, advs, strict=True):
        p = torch.tensor(g.prompt.prompt_ids, dtype=torch.int64)
        zeros = torch.zeros(len(p), dtype=torch.float32)
        ids.append(torch.cat([p, s.token_ids.to(torch.int64)]))
        mask.append(torch.cat([zeros, s.mask()]))
        behav.append(torch.cat([zeros, s.logprobs.float()]))
        adv.append(torch.cat([zeros, a.float()]))
        if gae:
            rets.append(torch.cat([zeros, _require(s.returns, "returns")]))
            vals.append(torch.cat([zeros, _require(s.values, "values")]))
        cu.append(cu[-1] + len(p) + s.length)
    return TrainBatch(
        step=step,
        input_ids=_cat(ids, torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64),
        loss_mask=_cat(mask, torch.float32),
        behaviour_logprobs=_cat(behav, torch.float32),
        advantages=_cat(adv, torch.float32),
        global_num_tokens=num_tokens,
        global_num_seqs=num_seqs,
        returns=_cat(rets, torch.float32) if gae else None,
        old_values=_cat(vals, torch.float32) if gae else None,
    )


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype)


def _require(t: torch.Tensor | None, what: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"sample has no {what} (GAE needs critic values)")
    return t.float()


def _stats(pairs: list[tuple[Group, SampleRec]], num_tokens: int) -> BatchStats:
    rewards = torch.tensor([float(s.reward or 0.0) for _, s in pairs]) if pairs else torch.zeros(1)
    multi = [s for _, s in pairs if s.num_turns]
    return BatchStats(
        num_samples=len(pairs),
        num_response_tokens=num_tokens,
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std(unbiased=False)),
        response_len_mean=num_tokens / max(1, len(pairs)),
        turns_mean=sum(s.num_turns for s in multi) / len(multi) if multi else None,
        env_tokens_mean=sum(s.length - s.num_sampled for s in multi) / len(multi) if multi else None,
    )
