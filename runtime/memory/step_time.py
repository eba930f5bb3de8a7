"""How long the trainer's step will take, estimated from the config alone, before the run starts.

`step_time(cfg, shape)` adds four parts, each from a named assumption (docs/memory.md, "The plan's
step time"), and counts no overlap between them (an upper bound where copies overlap compute):

* compute: 6 x active parameters x trained tokens (prompt + response of every sample of a step,
  times `ppo_epochs`) at `ASSUMED_MFU` of `PEAK_TFLOPS`, split over the trainer ranks;
* `trainer.offload.optimizer`: AdamW's moments (8 bytes per trained parameter) streamed in and out
  of pinned host memory at `PINNED_GBPS` each way, both ways at once, per optimizer step;
* `trainer.offload.params`: the master weights out to (pageable) host memory after the update
  and back before the step, at `PAGEABLE_GBPS`;
* `fsdp.cpu_offload` (FSDP2's full offload): the master shards copied in (once per optimizer step
  on one rank, where they stay gathered; twice per micro-batch on several), every micro-batch's
  gradients copied out at `PAGEABLE_GBPS` and added on the host, then gradient clipping and
  torch's AdamW on the CPU, each a pass over host memory at `HOST_GBPS`.

The benchmark (benchmarks/async_vs_sync.py) records the estimate (`plan_train_s`) beside the
measured training time of a step, so each assumption can be checked against a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.config import RunConfig
from runtime.memory.estimate import BYTES, ModelShape

PEAK_TFLOPS = 989.0  # bf16 dense, H100 SXM and H200 (the GPUs the recipes are measured on)
# 6N MFU of a compiled 1-rank FSDP2 step at 8k-16k-token micro-batches: the 1.54B recipe on one
# H100 at 39 % (sync), the 7.62B recipe on one H200 at 38 % once its streamed optimizer step is
# left out (34.3 % with it; BENCHMARKS.md).
ASSUMED_MFU = 0.38
# Pinned host <-> GPU: the 7.62B recipe's streamed optimizer step moved 61 GB each way in 1.33 s on
# one H200's host (BENCHMARKS.md, "Bigger models on one H200").
PINNED_GBPS = 45.0
PAGEABLE_GBPS = 12.0  # pageable host memory through the driver's staging buffers: assumed, not measured
HOST_GBPS = 50.0  # torch's multi-threaded elementwise CPU kernels on a 16-core host: assumed, not measured
CPU_ADAMW_BYTES = 80  # torch's single-tensor AdamW: about ten float32 streams read or written per parameter
CPU_CLIP_BYTES = 12  # the gradient norm (one read) and the clip's scale (a read and a write)
CPU_ADD_BYTES = 12  # a micro-batch's gradient added to the host one (two reads, a write)


@dataclass(frozen=True)
class StepTime:
    """The trainer's estimated time for one training step (`train_s`), in parts."""

    parts: dict[str, float]  # seconds: compute, and each offload's copies and host work

    @property
    def total_s(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        """The plan's line: the total, its parts and the assumptions they rest on."""
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.parts.items())
        return (
            f"trainer step: about {self.total_s:.1f} s ({parts}; assumed: {ASSUMED_MFU:.0%} MFU of "
            f"{PEAK_TFLOPS:g} TFLOP/s, host<->GPU {PINNED_GBPS:g} GB/s pinned, {PAGEABLE_GBPS:g} GB/s pageable, "
            f"host memory {HOST_GBPS:g} GB/s; no overlap counted)"
        )


def step_tokens(cfg: RunConfig) -> int:
    """Tokens one training step trains on: every sample's prompt and response. The response is
    `rollout.max_tokens` (exact with `ignore_eos`, else a bound); the prompt is
    `data.synthetic_prompt_len` for synthetic data, else what `max_model_len` leaves (a bound)."""
    r, d = cfg.rollout, cfg.data
    prompt = d.synthetic_prompt_len if d.source == "synthetic" else r.engine.max_model_len - r.max_tokens
    return cfg.trainer.prompts_per_step * r.n * (max(0, prompt) + r.max_tokens)


def step_time(cfg: RunConfig, shape: ModelShape, ranks: int) -> StepTime:
    """The estimate for `cfg`'s actor on `ranks` GPUs (see the module docstring)."""
    t, f = cfg.trainer, cfg.fsdp
    ranks = max(1, ranks)
    tokens = step_tokens(cfg)
    n = shape.num_params
    trained = shape.lora_params(t.lora.rank, t.lora.target_modules) if t.lora.rank else n
    shard = ranks if f.use_fsdp and f.sharding_strategy != "NO_SHARD" else 1
    updates = t.ppo_epochs * t.mini_batches  # optimizer steps per training step
    flops = 6 * shape.active_params * tokens * t.ppo_epochs
    parts = {"compute": flops / ranks / (ASSUMED_MFU * PEAK_TFLOPS * 1e12)}
    gb = 1e9
    if t.offload.optimizer:
        parts["optimizer offload"] = updates * 8 * trained / shard / gb / PINNED_GBPS
    if t.offload.params:
        parts["parameter offload"] = 2 * BYTES[f.param_dtype] * n / shard / gb / PAGEABLE_GBPS
    if f.cpu_offload:
        master_b = BYTES[f.param_dtype]
        grad_b = BYTES[f.mixed_precision.reduce_dtype] if f.mixed_precision else master_b
        micro = max(1, math.ceil(tokens / ranks / t.mini_batches / t.micro_batch_tokens))
        gathers = 1 if ranks == 1 else 2 * micro
        per_update = (gathers * master_b * n + micro * grad_b * trained) / shard / gb / PAGEABLE_GBPS
        parts["host<->GPU copies"] = updates * per_update
        host = ((micro - 1) * CPU_ADD_BYTES + CPU_CLIP_BYTES + CPU_ADAMW_BYTES) * trained / shard / gb / HOST_GBPS
        parts["CPU optimizer"] = updates * host
    return StepTime(parts)
