"""Rollout role vs bare vLLM, and in-place weight-update time. Prints one JSON object.

In one run, on the same machine and with the same engine options and requests:

* baseline: `AsyncLLM` driven directly in this process (`generate()` for every request
  at once, final outputs only, per-token logprobs on) — the fastest way to call vLLM;
* role: the rollout role as its own process, driven over its ZeroMQ channel exactly as
  the controller drives it (`Generate` in, one `Completion` per sample out).

Throughput is output tokens per second over the whole batch; the figure is the median
of `--reps` repetitions after one warm-up. The update figure is the median time of a
whole update of the model, sent as the trainer sends it (buckets of
`weight_sync.bucket_mb`, by the backend `weight_sync.backend` picks for a trainer on GPU 0
beside the rollout: `ipc` on a GPU, `zmq` on the CPU), from the first bucket packed to
the `WeightsApplied` reply, with the phase split and the role's own receive / load /
total times.

    .venv/bin/python benchmarks/rollout.py [--prompts 64] [--max-tokens 128] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# vLLM logs to stdout by default; stdout is for this benchmark's one JSON object.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
# The bare engine starts in this process; forked workers hung there on a GPU (2026-11-30).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from runtime.config import RunConfig
from runtime.config_load import load_config
from runtime.logs import setup_logging


def requests(num: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(prompt_len)] for _ in range(num)]


async def bare_vllm(cfg: RunConfig, prompts: list[list[int]], max_tokens: int, reps: int) -> list[float]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    e = cfg.rollout.engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(e.cpu_kvcache_gb))
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(Path(cfg.run_dir) / "model"), skip_tokenizer_init=True, dtype=e.dtype,
            max_model_len=e.max_model_len, enforce_eager=e.enforce_eager, seed=e.seed,
            max_num_seqs=e.max_num_seqs, enable_prefix_caching=e.enable_prefix_caching,
            gpu_memory_utilization=e.gpu_memory_utilization,
        )
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )

    async def one(i: int, ids: list[int], tag: str) -> int:
        async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=f"{tag}-{i}"):
            if out.finished:  # FINAL_ONLY: the one output there is
                return len(out.outputs[0].token_ids)
        raise RuntimeError(f"request {tag}-{i} ended without a final output")

    rates = []
    try:
        for rep in range(reps + 1):
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*[one(i, p, f"r{rep}") for i, p in enumerate(prompts)]))
            if rep:  # rep 0 warms up
                rates.append(tokens / (time.perf_counter() - start))
    finally:
        engine.shutdown()
    return rates


async def role(cfg: RunConfig, prompts: list[list[int]], max_tokens: int, reps: int) -> tuple[list[float], dict]:
    from tests.helpers.harness import RoleHarness
    from transport import wire

    harness = RoleHarness(cfg, "rollout")
    await harness.start()
    spec = wire.SamplingSpec(n=1, max_tokens=max_tokens, ignore_eos=True)
    rates = []
    try:
        for rep in range(reps + 1):
            start = time.perf_counter()
            for i, p in enumerate(prompts):
                await harness.send(wire.Generate(request_id=f"r{rep}-{i}", group_id=i, prompt_ids=p, sampling=spec))
            tokens = 0
            for _ in prompts:
                tokens += (await harness.next(wire.Completion)).token_ids.numel()
            if rep:
                rates.append(tokens / (time.perf_counter() - start))
        update = await weight_updates(harness, reps=5)
    finally:
        await harness.stop()
    return rates, update


async def weight_updates(harness, reps: int) -> dict:
    import torch
    from safetensors.torch import load_file

    from roles.weights.backend import choose_backend
    from roles.weights.ipc import device_uuid
    from tests.helpers.weights import TrainerSide

    cfg = harness.cfg
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    uuid = device_uuid(device) if device.type == "cuda" else ""
    backend = choose_backend(cfg.weight_sync.backend, device, uuid, [harness.peer])
    tensors = {k: v.to(device) for k, v in load_file(Path(cfg.run_dir) / "model" / "model.safetensors").items()}
    side = TrainerSide(
        harness, backend, device, timeout_s=cfg.weight_sync.timeout_s, bucket_mb=cfg.weight_sync.bucket_mb
    )
    await side.connect()
    times, applied, phases = [], [], []
    for version in range(1, reps + 1):
        result = await side.push(version, tensors)
        if result.failed:
            raise RuntimeError(str(next(iter(result.failed.values()))))
        times.append(result.seconds)
        applied.append(result.applied[f"{harness.role}-{harness.rank}"])
        phases.append(result.phases)
    await side.aclose()
    return {
        "update_backend": backend,
        "update_bucket_mb": cfg.weight_sync.bucket_mb,
        "update_s_median": statistics.median(times),
        "update_s_max": max(times),
        "update_phases_s_median": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "role_receive_s_median": statistics.median(a.receive_s for a in applied),
        "role_load_s_median": statistics.median(a.load_s for a in applied),
        "role_total_s_median": statistics.median(a.total_s for a in applied),
        "update_mb": applied[0].num_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests (smoke test)")
    parser.add_argument("--config", default="configs/tiny_cpu.yaml", help="recipe whose model and engine to use")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (e.g. for a GPU)")
    args = parser.parse_args()
    setup_logging(None, "bench", level="warning")  # stderr: stdout carries only the JSON
    if args.quick:
        args.prompts, args.max_tokens, args.reps = 16, 16, 1
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-rollout-"))
    # The engine must hold prompt + response; requests that cannot fit would only measure errors.
    fit = f"rollout.engine.max_model_len={max(256, args.prompt_len + args.max_tokens + 1)}"
    cfg = load_config(args.config, [f"run_dir={run_dir}", "rollout.engine.max_num_seqs=256", fit, *args.overrides])
    from runtime.launcher import prepare_run_dir

    prepare_run_dir(cfg)
    prompts = requests(args.prompts, args.prompt_len)
    base = asyncio.run(bare_vllm(cfg, prompts, args.max_tokens, args.reps))
    ours, update = asyncio.run(role(cfg, prompts, args.max_tokens, args.reps))
    result = {
        "benchmark": "rollout",
        "requests": args.prompts,
        "max_tokens": args.max_tokens,
        "bare_vllm_tokens_per_s": statistics.median(base),
        "role_tokens_per_s": statistics.median(ours),
        "role_over_bare": statistics.median(ours) / statistics.median(base),
        "bare_runs": base,
        "role_runs": ours,
        **update,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
