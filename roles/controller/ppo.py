"""PPO with a critic, controller side: value requests, token rewards (with the optional
KL penalty) and GAE per sample, as plain functions over groups.

Alignment: a sample's response token j sits at packed position `P + j` (P = prompt
length); the critic and the reference policy answer per packed position (see
roles/critic/fsdp_engine.py), so the response's values / reference logprobs are the slice
`[start + P, start + P + R)` of its sequence.
"""

from __future__ import annotations

import torch

from roles.algo import compute_advantages, explained_variance, kl_controller, kl_penalty, masked_mean, whiten
from roles.controller.batching import assign_shards
from roles.controller.groups import Group, SampleRec
from runtime.config import KLConfig
from transport.wire import ValueRequest, ValueResult

Pair = tuple[Group, SampleRec]


def value_requests(groups: list[Group], num_shards: int) -> tuple[list[ValueRequest], list[list[Pair]]]:
    """One request per critic rank and the (group, sample) pairs each covers, in order."""
    pairs = [(g, s) for g in groups for s in g.ordered()]
    lengths = [len(g.prompt.prompt_ids) + s.length for g, s in pairs]
    shards = assign_shards(lengths, num_shards)
    requests, covered = [], []
    for idx in shards:
        chosen = [pairs[i] for i in idx]
        ids = [torch.cat([torch.tensor(g.prompt.prompt_ids, dtype=torch.int64), s.token_ids.long()]) for g, s in chosen]
        cu = [0]
        for t in ids:
            cu.append(cu[-1] + len(t))
        input_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
        requests.append(ValueRequest(input_ids=input_ids, cu_seqlens=torch.tensor(cu, dtype=torch.int64)))
        covered.append(chosen)
    return requests, covered


def apply_values(pairs: list[Pair], result: ValueResult) -> None:
    """Store each sample's response values (and reference logprobs) from one shard's reply."""
    start = 0
    for g, s in pairs:
        p = len(g.prompt.prompt_ids)
        s.values = result.values[start + p : start + p + s.length].float().clone()
        if result.ref_logprobs is not None:
            s.ref_logprobs = result.ref_logprobs[start + p : start + p + s.length].float().clone()
        start += p + s.length


def token_rewards(s: SampleRec, kl_coef: float, estimator: str | None) -> torch.Tensor:
    """The sample's reward on its last sampled token, minus `kl_coef` × KL(behaviour ‖
    reference) on each sampled token; 0 on environment tokens (multi-turn)."""
    mask = s.mask()
    rewards = torch.zeros(s.length, dtype=torch.float32)
    sampled = mask.nonzero()
    if sampled.numel():
        rewards[int(sampled[-1])] = float(s.reward or 0.0)
    if estimator is not None and s.ref_logprobs is not None and s.length:
        kl = kl_penalty(s.logprobs.float()[None], s.ref_logprobs[None], estimator)[0]
        rewards = rewards - kl_coef * kl * mask
    return rewards


def sample_gae(s: SampleRec, *, gamma: float, lam: float, kl_coef: float, estimator: str | None) -> None:
    """Token-level GAE of one sample over its sampled tokens (carried across environment
    tokens, terminal after its last sampled token); sets advantages/returns (0 on
    environment tokens)."""
    if s.values is None:
        raise ValueError("GAE needs the sample's critic values")
    s.token_rewards = token_rewards(s, kl_coef, estimator)
    mask = s.mask()
    reward = torch.tensor([float(s.reward or 0.0)])
    adv = compute_advantages(
        "gae",
        reward,
        torch.zeros(1, dtype=torch.int64),
        mask_BT=mask[None],
        token_rewards_BT=s.token_rewards[None],
        values_BT=s.values[None],
        gamma=gamma,
        lam=lam,
    )[0]
    s.advantages = adv
    s.returns = torch.where(mask != 0, adv + s.values, torch.zeros_like(adv))  # GAE's returns: A + V


def whiten_groups(groups: list[Group]) -> None:
    """Whiten the token advantages of every sample of a batch together (mean 0, std 1 over
    sampled tokens; environment tokens stay 0)."""
    samples = [s for g in groups for s in g.ordered() if s.advantages is not None and s.length]
    if not samples:
        return
    flat = torch.cat([s.advantages for s in samples])  # type: ignore[misc]
    white = whiten(flat[None], torch.cat([s.mask() for s in samples])[None])[0]
    start = 0
    for s in samples:
        s.advantages = white[start : start + s.length].clone()
        start += s.length


def mean_kl(groups: list[Group], estimator: str) -> float:
    """Mean per-token KL(behaviour ‖ reference) of a batch over sampled tokens (for the
    adaptive coefficient; environment tokens have no behaviour logprob)."""
    pairs = [
        (kl_penalty(s.logprobs.float()[None], s.ref_logprobs[None], estimator)[0], s.mask())
        for g in groups
        for s in g.ordered()
        if s.ref_logprobs is not None and s.length
    ]
    if not pairs:
        return 0.0
    return masked_mean(torch.cat([kl for kl, _ in pairs]), torch.cat([m for _, m in pairs])).item()


class RewardKL:
    """The KL penalty folded into token rewards (`algorithm.kl.use=reward`): its estimator
    and its fixed or adaptive coefficient. The value stage reads `coef` when it computes
    token rewards; the training stage calls `update` once per step with that step's batch."""

    def __init__(self, cfg: KLConfig) -> None:
        self.estimator = cfg.estimator
        self.ctl = kl_controller(cfg.coef, adaptive=cfg.adaptive, target=cfg.target, horizon=cfg.horizon)

    @property
    def coef(self) -> float:
        return self.ctl.value

    def update(self, groups: list[Group]) -> dict[str, float]:
        """Adapt the coefficient to the batch's mean KL; the step's metrics."""
        kl = mean_kl(groups, self.estimator)
        self.ctl.update(kl, sum(1 for g in groups for s in g.ordered() if s.length))
        return {"kl_reward_penalty": kl, "kl_coef": self.ctl.value}


def value_metrics(groups: list[Group]) -> dict[str, float]:
    """How well the critic's values predicted the returns of a batch."""
    samples = [s for g in groups for s in g.ordered() if s.length and s.values is not None and s.returns is not None]
    values = torch.cat([s.values for s in samples])  # type: ignore[misc]
    returns = torch.cat([s.returns for s in samples])  # type: ignore[misc]
    mask = torch.cat([s.mask() for s in samples])
    return {
        "critic_explained_variance": explained_variance(values, returns, mask),
        "values_mean": masked_mean(values, mask).item(),
        "returns_mean": masked_mean(returns, mask).item(),
    }
