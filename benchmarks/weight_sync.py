"""Weight-sync benchmark: one model, every backend this machine allows, N updates each, into
one real rollout role. Prints one JSON object.

    python3 benchmarks/weight_sync.py                                   # the 1.54B bench model, one H200
    python3 benchmarks/weight_sync.py --config configs/tiny_cpu.yaml --updates 3   # CPU
    python3 benchmarks/weight_sync.py --quick                           # smoke test (CPU, tiny model)

The rollout role (vLLM) runs as its own process on GPU 0 (or the CPU), driven over its
real sockets (tests/helpers/harness.py). The trainer side runs in this process with the
trainer role's own sender, transfers and packer (tests/helpers/weights.py), from the
model's weights held where trainer rank 0 would hold them: on GPU 0 for `ipc` (the
colocated placement) and `zmq`, on GPU 1 for `nccl`; on the CPU without a GPU (`nccl`
then runs over gloo). Backends: `zmq` always; `ipc` with a GPU; `nccl` with two GPUs or
none. Each backend gets one warm-up update, then `--updates` timed ones.

`--busy GROUPS` times every backend a second time while the rollout generates (rows
`<backend>:busy`: GROUPS requests of `rollout.n` samples kept in flight, 1 s of generation
between updates), as it does in an async run, where each update has to pause a busy
engine; `--bucket-mb 256,1024` compares bucket sizes (rows `<backend>@<mb>MB`).

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

from benchmarks.json_out import provenance

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the JSON
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import torch

from runtime.config import RunConfig
from runtime.logs import setup_logging
from runtime.memory.auto import load_settled


def backends(cpu_only: bool) -> list[str]:
    gpus = 0 if cpu_only else torch.cuda.device_count()
    return ["zmq"] + (["ipc"] if gpus >= 1 else []) + (["nccl"] if gpus >= 2 or gpus == 0 else [])


def sender_device(backend: str, gpus: int) -> torch.device:
    if gpus == 0:
        return torch.device("cpu")
    return torch.device("cuda", 1 if backend == "nccl" else 0)


class Load:
    """Keeps the rollout generating, as it does in an async run: `groups` requests of
    `cfg.rollout.n` samples in flight, each replaced when its last sample comes back.
    Leaving waits for the requests in flight to finish (there is no cancel message)."""

    serial = 0  # request ids stay unique across loads

    def __init__(self, harness: Any, cfg: RunConfig, groups: int) -> None:
        self.harness, self.cfg, self.groups = harness, cfg, groups
        self.tokens = 0
        self.stopping = False
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        from transport import wire

        spec = wire.SamplingSpec(
            n=self.cfg.rollout.n, max_tokens=self.cfg.rollout.max_tokens, temperature=1.0, ignore_eos=True
        )
        gen = torch.Generator().manual_seed(0)
        left: dict[str, int] = {}

        async def submit() -> None:
            Load.serial += 1
            rid = f"load-{Load.serial}"
            left[rid] = spec.n
            prompt = torch.randint(3, 250, (16,), generator=gen).tolist()
            await self.harness.send(
                wire.Generate(request_id=rid, group_id=Load.serial, prompt_ids=prompt, sampling=spec)
            )

        for _ in range(self.groups):
            await submit()
        while left:
            c = await self.harness.next(wire.Completion, timeout=600)
            if c.request_id not in left:
                continue
            self.tokens += c.token_ids.numel()
            left[c.request_id] -= 1
            if left[c.request_id] == 0:
                del left[c.request_id]
                if not self.stopping:
                    await submit()

    async def __aenter__(self) -> Load:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(5.0)  # let the engine fill its batch
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self.stopping = True
        await asyncio.wait_for(self._task, 600)


async def run(
    cfg: RunConfig, names: list[str], updates: int, bucket_mbs: list[int], busy_groups: int
) -> dict[str, Any]:
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
            for mb in bucket_mbs:
                side = TrainerSide(harness, backend, device, timeout_s=cfg.weight_sync.timeout_s, bucket_mb=mb)
                await side.connect()
                for busy in [False, True] if busy_groups else [False]:
                    results = []
                    load = Load(harness, cfg, busy_groups) if busy else None
                    if load is not None:
                        await load.__aenter__()
                    started = time.perf_counter()
                    try:
                        for _ in range(updates + 1):
                            version += 1
                            result = await side.push(version, tensors)
                            if result.failed:
                                raise RuntimeError(f"{backend}: {next(iter(result.failed.values()))}")
                            results.append(result)
                            if load is not None:
                                await asyncio.sleep(1.0)  # generation between updates, as between steps
                    finally:
                        if load is not None:
                            await load.__aexit__(None, None, None)
                    row = summarize(results[0], results[1:])
                    row["bucket_mb"] = mb
                    if load is not None:
                        row["busy_groups"] = busy_groups
                        row["busy_tok_per_s"] = round(load.tokens / (time.perf_counter() - started), 1)
                    key = backend + ("" if len(bucket_mbs) == 1 else f"@{mb}MB") + (":busy" if busy else "")
                    out[key] = row
                await side.aclose()
            del tensors
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
    parser.add_argument("--config", default="configs/bench_1.5b.yaml", help="recipe whose model and engine to use")
    parser.add_argument("--updates", type=int, default=10, help="timed updates per backend (after one warm-up)")
    parser.add_argument("--backends", default="", help="comma-separated subset (default: all this machine allows)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 2 updates")
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument(
        "--bucket-mb", default="", help="comma-separated bucket sizes to compare (default: the config's)"
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="GROUPS",
        help="also time every backend while the rollout generates GROUPS requests of rollout.n samples (rows ':busy')",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    setup_logging(None, "bench", level="warning")
    if args.quick:
        args.config, args.updates = "configs/tiny_cpu.yaml", 2
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-weights-"))
    cfg = load_settled(args.config, [f"run_dir={run_dir}", *args.overrides])
    from runtime.launch.launcher import prepare_run_dir

    prepare_run_dir(cfg)
    names = args.backends.split(",") if args.backends else backends(cpu_only=args.quick)
    bucket_mbs = [int(x) for x in args.bucket_mb.split(",")] if args.bucket_mb else [cfg.weight_sync.bucket_mb]
    rows = asyncio.run(run(cfg, names, args.updates, bucket_mbs, args.busy))
    result = {
        "benchmark": "weight_sync",
        "config": args.config,
        **provenance(),
        "machine": {
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "bucket_mb": bucket_mbs,
        "busy_groups": args.busy,
        "backends": rows,
    }
    text = json.dumps(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
