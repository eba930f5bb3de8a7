"""Weight-sync benchmark: one model, every backend this machine allows, N updates each, into
one real rollout role. Prints one JSON object.

    python3 benchmarks/weight_sync.py                                   # 1.31B bench model, one H200
    python3 benchmarks/weight_sync.py --config configs/tiny_cpu.yaml --updates 3   # CPU
    python3 benchmarks/weight_sync.py --quick                           # smoke test (CPU, tiny model)

The rollout role (vLLM) runs as its own process on GPU 0 (or the CPU), driven over its
real sockets (tests/helpers/harness.py). The trainer side runs in this process with the
trainer role's own sender, transfers and packer (tests/helpers/weights.py), from the
model's weights held where trainer rank 0 would hold them: on GPU 0 for `ipc` (the
colocated placement) and `zmq`, on GPU 1 for `nccl`; on the CPU without a GPU (`nccl`
then runs over gloo). Backends: `zmq` always; `ipc` with a GPU; `nccl` with two GPUs or
none. Each backend gets one warm-up update, then `--updates` timed ones.

Per backend: the median seconds of an update end to end (first bucket packed to the last
`WeightsApplied`, vLLM's load included), GB/s over it, the median phase split
(`gather_s`: packing on the trainer side; `transfer_s`: moving the bytes; `load_s`: vLLM's
`load_weights`; the phases overlap, bucket by bucket), the first (warm-up) update, and
`speedup_vs_zmq`, the ratio of the zmq median to this backend's, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the JSON
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import torch

from runtime.config import RunConfig
from runtime.config_load import load_config
from runtime.logs import setup_logging


def backends(cpu_only: bool) -> list[str]:
    gpus = 0 if cpu_only else torch.cuda.device_count()
    return ["zmq"] + (["ipc"] if gpus >= 1 else []) + (["nccl"] if gpus >= 2 or gpus == 0 else [])


def sender_device(backend: str, gpus: int) -> torch.device:
    if gpus == 0:
        return torch.device("cpu")
    return torch.device("cuda", 1 if backend == "nccl" else 0)


async def run(cfg: RunConfig, names: list[str], updates: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from tests.helpers.harness import RoleHarness
    from tests.helpers.weights import TrainerSide

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpu_weights = load_file(Path(cfg.run_dir) / "model" / "model.safetensors")
    harness = RoleHarness(cfg, "rollout")
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the rollout's GPU, as placement `devices: [0]` gives it
    try:
        await harness.start(timeout=900)
    finally:
        if env_before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_before
    out: dict[str, Any] = {}
    version = 0
    try:
        for backend in names:
            device = sender_device(backend, gpus)
            tensors = {k: v.to(device) for k, v in cpu_weights.items()}
            side = TrainerSide(
                harness, backend, device, timeout_s=cfg.weight_sync.timeout_s, bucket_mb=cfg.weight_sync.bucket_mb
            )
            await side.connect()
            results = []
            for _ in range(updates + 1):
                version += 1
                result = await side.push(version, tensors)
                if result.failed:
                    raise RuntimeError(f"{backend}: {next(iter(result.failed.values()))}")
                results.append(result)
            await side.aclose()
            del tensors
            out[backend] = summarize(results[0], results[1:])
    finally:
        await harness.stop()
    if "zmq" in out:
        for row in out.values():
            row["speedup_vs_zmq"] = out["zmq"]["update_s_median"] / row["update_s_median"]
    return out


def summarize(first: Any, timed: list[Any]) -> dict[str, Any]:
    med = statistics.median(r.seconds for r in timed)
    return {
        "updates": len(timed),
        "update_s_median": med,
        "update_s_runs": [round(r.seconds, 4) for r in timed],
        "first_update_s": first.seconds,
        "gb": first.num_bytes / 1e9,
        "gb_per_s": first.num_bytes / 1e9 / med,
        "phases_s_median": {
            k: statistics.median(r.phases[k] for r in timed) for k in ("gather_s", "transfer_s", "load_s")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/bench_h200x1.yaml", help="recipe whose model and engine to use")
    parser.add_argument("--updates", type=int, default=10, help="timed updates per backend (after one warm-up)")
    parser.add_argument("--backends", default="", help="comma-separated subset (default: all this machine allows)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 2 updates")
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    setup_logging(None, "bench", level="warning")
    if args.quick:
        args.config, args.updates = "configs/tiny_cpu.yaml", 2
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-weights-"))
    cfg = load_config(args.config, [f"run_dir={run_dir}", *args.overrides])
    from runtime.launcher import prepare_run_dir

    prepare_run_dir(cfg)
    names = args.backends.split(",") if args.backends else backends(cpu_only=args.quick)
    started = time.time()
    rows = asyncio.run(run(cfg, names, args.updates))
    result = {
        "benchmark": "weight_sync",
        "config": args.config,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": {
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "bucket_mb": cfg.weight_sync.bucket_mb,
        "backends": rows,
    }
    text = json.dumps(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
