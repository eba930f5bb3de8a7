"""One metrics record per training step (see docs/metrics.md): the batch's
rewards, lengths and staleness, drops, throughput and idle ratios over the window since
the previous step, and the trainer's (and critic's) own numbers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from roles.controller.batching import BatchStats
from roles.controller.metrics import TRAINER_REQUIRED_KEYS, MetricsSink
from transport import wire

# The trainer's metrics a step record copies: the required ones (metrics.py), then the rest.
TRAINER_KEYS = (
    *TRAINER_REQUIRED_KEYS,
    "lr",
    "train_s",
    "kl_ref",
    "kl_coef",
    "weight_sync_gb",
    "weight_sync_gather_s",
    "weight_sync_transfer_s",
    "weight_sync_load_s",
    "cuda_free_gb",
    "cuda_peak_gb",
    "optimizer_steps",
    "ratio_max",
    "importance_weight_mean",
    "truncated_fraction",
    "masked_fraction",
    "behaviour_proximal_abs_diff",
    "dual_clip_fraction",
    "micro_batches",
    "padding_fraction",
    "cuda_reserved_gb",
    "host_peak_gb",
    "optimizer_offload_s",
    "params_restore_s",
    "release_s",
    "update_skipped",
    "nonfinite_rank",
    "nonfinite_micro_batch",
    "router_aux_loss",
    "router_disagree",
    "routing_mismatch",
    "routed_tokens",
)


class StepRecorder:
    def __init__(self, sink: MetricsSink, gen_busy_s: Callable[[], float], *, wall_offset: float = 0.0) -> None:
        """`gen_busy_s()`: the rollouts' busy time so far; `wall_offset`: wall time of the
        steps before a resume."""
        self.sink = sink
        self.gen_busy_s = gen_busy_s
        self.wall_offset = wall_offset
        self.start_clock()

    def start_clock(self) -> None:
        """The run starts now (all roles registered); `started_at`: its Unix time."""
        self.run_started = self.last_step_at = time.monotonic()
        self.started_at = time.time()
        self.last_busy = self.gen_busy_s()

    def wall_s(self) -> float:
        return self.wall_offset + time.monotonic() - self.run_started

    def record(
        self,
        step: int,
        result: wire.TrainResult,
        stats: BatchStats,
        staleness: list[int],
        drops: dict[str, int],
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        """Write step `step`'s record; `drops`: samples dropped this step by reason
        (`dropped_stale`, `dropped_error`) and in total (`dropped_stale_total`)."""
        now = time.monotonic()
        window = max(now - self.last_step_at, 1e-9)
        gen_busy = self.gen_busy_s() - self.last_busy
        m = result.metrics
        train_busy = float(m.get("busy_s", 0.0))
        rec: dict[str, Any] = {
            "step": step,
            "policy_version": result.version,
            "reward_mean": stats.reward_mean,
            "reward_std": stats.reward_std,
            "response_len_mean": stats.response_len_mean,
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            "staleness_max": max(staleness, default=0),
            "dropped_stale": drops.get("dropped_stale", 0),
            "dropped_stale_total": drops.get("dropped_stale_total", 0),
            "dropped_error": drops.get("dropped_error", 0),
            **{k: v for k, v in drops.items() if k.startswith("dropped_error_")},
            "dropped_filtered": drops.get("dropped_filtered", 0),
            "dropped_filtered_total": drops.get("dropped_filtered_total", 0),
            "samples_per_s": stats.num_samples / window,
            "tokens_per_s": stats.num_response_tokens / window,
            "gen_busy_s": gen_busy,
            "train_busy_s": train_busy,
            "rollout_idle_ratio": max(0.0, 1.0 - gen_busy / window),
            "trainer_idle_ratio": max(0.0, 1.0 - train_busy / window),
            "step_s": window,
            "wall_s": self.wall_offset + now - self.run_started,
            **{k: m[k] for k in TRAINER_KEYS if k in m},
            **extra,
        }
        for k in TRAINER_REQUIRED_KEYS:
            rec.setdefault(k, 0.0)
        if stats.turns_mean is not None:  # multi-turn runs only
            rec.update(turns_mean=stats.turns_mean, env_tokens_mean=stats.env_tokens_mean)
        self.sink.write(rec)
        self.last_step_at, self.last_busy = now, self.gen_busy_s()
        return rec
