"""One training step, controller side: take a fresh batch (dropping stale groups), send
each trainer rank (and critic rank) its shard, publish the new version, write the
step's metrics, and checkpoint every `checkpoint.every` steps."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roles.algo import explained_variance
from roles.controller import state as cstate
from roles.controller.batching import BatchStats, build_train_batches
from roles.controller.groups import Group
from roles.controller.ppo import mean_kl, whiten_groups
from runtime import checkpoint
from runtime.logs import get_logger, set_policy_version
from transport import wire

if TYPE_CHECKING:
    from roles.controller.role import Controller

log = get_logger("controller")
TRAINER_KEYS = ("weight_sync_s", "loss", "kl_behaviour_proximal", "importance_weight_max", "clip_fraction",
                "entropy", "grad_norm", "lr", "train_s", "kl_ref", "kl_coef", "weight_sync_gb",
                "weight_sync_gather_s", "weight_sync_transfer_s", "weight_sync_load_s", "cuda_free_gb")  # fmt: skip


class StepRunner:
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.last_step_at = time.monotonic()
        self.last_busy = 0.0
        self.run_started = time.monotonic()

    def start_clock(self) -> None:
        self.run_started = self.last_step_at = time.monotonic()
        self.last_busy = self.ctl.gen_busy_s()

    async def take_batch(self) -> list[Group]:
        """`prompts_per_step` fresh groups, FIFO; stale ones met on the way are dropped."""
        ctl = self.ctl
        want = ctl.cfg.trainer.prompts_per_step
        while True:
            batch: list[Group] = []
            while ctl.ready and len(batch) < want:
                g = ctl.ready.popleft()
                if ctl.gate.is_fresh(g.version):
                    batch.append(g)
                else:
                    ctl.drop(g, "dropped_stale", f"version {g.version} at trainer version {ctl.gate.version}")
            if len(batch) == want:
                return batch
            ctl.ready.extendleft(reversed(batch))
            ctl.ready_changed.clear()
            await ctl.ready_changed.wait()

    async def step(self) -> None:
        ctl = self.ctl
        cfg = ctl.cfg
        groups = await self.take_batch()
        gae = cfg.algorithm.advantage == "gae"
        if gae and cfg.algorithm.whiten_advantages:
            whiten_groups(groups)
        build = dict(step=ctl.step, advantage=cfg.algorithm.advantage, norm_by_std=cfg.algorithm.norm_by_std)
        trainers, critics = ctl.registry.of("trainer"), ctl.registry.of("critic") if gae else []
        batches, stats = build_train_batches(groups, num_shards=len(trainers), **build)
        critic_batches = build_train_batches(groups, num_shards=len(critics), **build)[0] if critics else []
        staleness = [
            ctl.gate.staleness(int(s.versions.min())) for g in groups for s in g.ordered() if s.versions.numel()
        ]
        timeout = max(600.0, cfg.weight_sync.timeout_s * 3)
        sends = [
            ctl.server.request(b, peer=t.identity, timeout=timeout) for b, t in zip(batches, trainers, strict=True)
        ]
        sends += [
            ctl.server.request(b, peer=c.identity, timeout=timeout)
            for b, c in zip(critic_batches, critics, strict=True)
        ]
        replies = await asyncio.gather(*sends)
        actor = next(r for r in replies[: len(trainers)] if isinstance(r, wire.TrainResult) and r.metrics)
        critic = next((r for r in replies[len(trainers) :] if isinstance(r, wire.TrainResult) and r.metrics), None)
        for name in actor.failed_rollouts:
            ctl.rollout_failed(name, "new weights could not be delivered")
        ctl.gate.train(stats.num_samples)
        ctl.totals["trained_groups"] += len(groups)
        ctl.trained_uids.extend(g.prompt.uid for g in groups)
        ctl.step += 1
        ctl.gate.advance(actor.version)
        set_policy_version(actor.version)
        ctl.wake.set()
        extra = self._ppo_metrics(groups, critic) if gae else {}
        self.record(actor, stats, staleness, extra)
        log.info("trained", step=ctl.step, uids=[g.prompt.uid for g in groups])
        every = cfg.checkpoint.every
        if every and ctl.step % every == 0:
            await self.save_checkpoint()

    def _ppo_metrics(self, groups: list[Group], critic: wire.TrainResult | None) -> dict[str, float]:
        samples = [s for g in groups for s in g.ordered() if s.length]
        values = torch.cat([s.values for s in samples if s.values is not None])
        returns = torch.cat([s.returns for s in samples if s.returns is not None])
        out = {"critic_explained_variance": explained_variance(values, returns, torch.ones_like(values))}
        out["values_mean"] = float(values.mean())
        out["returns_mean"] = float(returns.mean())
        scoring = self.ctl.scoring
        if scoring.kl_estimator is not None:
            kl = mean_kl(groups, scoring.kl_estimator)
            scoring.kl_ctl.update(kl, len(samples))
            out.update(kl_reward_penalty=kl, kl_coef=scoring.kl_ctl.value)
        if critic is not None:
            out.update({f"critic_{k}": v for k, v in critic.metrics.items() if k != "explained_variance_local"})
        return out

    def record(self, result: wire.TrainResult, stats: BatchStats, staleness: list[int], extra: dict[str, Any]) -> None:
        ctl = self.ctl
        now = time.monotonic()
        window = max(now - self.last_step_at, 1e-9)
        gen_busy = ctl.gen_busy_s() - self.last_busy
        m = result.metrics
        train_busy = float(m.get("busy_s", 0.0))
        rec: dict[str, Any] = {
            "step": ctl.step,
            "policy_version": result.version,
            "reward_mean": stats.reward_mean,
            "reward_std": stats.reward_std,
            "response_len_mean": stats.response_len_mean,
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            "staleness_max": max(staleness, default=0),
            "dropped_stale": ctl.step_drops.get("dropped_stale", 0),
            "dropped_stale_total": ctl.totals["dropped_stale"],
            "dropped_error": ctl.step_drops.get("dropped_error", 0),
            "samples_per_s": stats.num_samples / window,
            "tokens_per_s": stats.num_response_tokens / window,
            "gen_busy_s": gen_busy,
            "train_busy_s": train_busy,
            "rollout_idle_ratio": max(0.0, 1.0 - gen_busy / window),
            "trainer_idle_ratio": max(0.0, 1.0 - train_busy / window),
            "step_s": window,
            "wall_s": ctl.wall_offset + now - self.run_started,
            **{k: m[k] for k in TRAINER_KEYS if k in m},
            **extra,
        }
        for k in (
            "weight_sync_s",
            "loss",
            "kl_behaviour_proximal",
            "importance_weight_max",
            "clip_fraction",
            "entropy",
            "grad_norm",
        ):
            rec.setdefault(k, 0.0)
        ctl.metrics.write(rec)
        self.last_step_at, self.last_busy = now, ctl.gen_busy_s()
        ctl.step_drops = {}

    async def save_checkpoint(self) -> Path:
        """Every trainer and critic rank saves its shards, the controller its state; then commit."""
        ctl = self.ctl
        started = time.perf_counter()
        tmp = checkpoint.begin(ctl.cfg.run_dir, ctl.step)
        save = wire.SaveCheckpoint(step=ctl.step, directory=str(tmp))
        peers = ctl.registry.of("trainer") + ctl.registry.of("critic")
        async with ctl.trainer_lock, ctl.critic_lock:
            await asyncio.gather(*[ctl.server.request(save, peer=p.identity, timeout=1800.0) for p in peers])
        (tmp / "controller.json").write_bytes(cstate.encode(ctl.snapshot()))
        final = checkpoint.commit(tmp, ctl.step, {"version": ctl.gate.version}, keep=ctl.cfg.checkpoint.keep)
        log.info("checkpoint_saved", step=ctl.step, path=str(final), seconds=round(time.perf_counter() - started, 3))
        return final
