"""The memory plan's trainer estimate against the trainer's measured peak, per recipe. Prints JSON.

For each `--config` (a recipe, `PATH@KEY=VALUE@...` with overrides of its own, and `--set
KEY=VALUE` overrides for all), one process on
one GPU builds the FSDP2 actor exactly as the recipe's trainer-0 does (the tiny model in
the recipe's shape, its `trainer`/`fsdp` settings) and runs `--steps` training steps on a
batch of the recipe's shape (`prompts_per_step * rollout.n` sequences of
`synthetic_prompt_len + rollout.max_tokens` tokens), then the weight export into
`weight_sync.bucket_mb` GPU buckets as an `ipc` push packs them. Per recipe:

* `plan_peak_gb`: the plan's trainer-0 peak (runtime/memory/plan.py, this GPU's size);
* `peak_gb`: `torch.cuda.max_memory_allocated` after the last step and export (what a
  run logs as `cuda_peak_gb`), `reserved_gb` the allocator's reserved peak;
* `estimate_over_measured`: their ratio (the acceptance asks 0.85-1.15);
* `resident_gb` / `plan_resident_gb`: allocated between steps (after `empty_cache`), the
  plan's `update` phase without the buckets;
* per step: `allocated_at_optimizer_gb` / `peak_before_optimizer_gb` (allocated when the
  optimizer step begins, and the peak of forward and backward until then), seconds,
  `mfu` (6 N tokens / time / `--peak-tflops`), `optimizer_offload_s`,
  and with `trainer.offload.params` the offload and restore seconds and whether the
  weights came back bit for bit.

    python3 benchmarks/memory_plan.py --config configs/bench_1.5b.yaml configs/bench_3b.yaml \
        configs/bench_7b.yaml configs/bench_7b.yaml@rollout.max_staleness=0@trainer.offload.params=true \
        --out benchmarks/results/memory_plan_h200x1.json

(The recipes' `auto` keys take what the memory plan chooses for this GPU; `--set KEY=VALUE`
pins them, e.g. `--set trainer.micro_batch_tokens=8192` as the committed H200 results ran.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.json_out import provenance
from runtime.memory.auto import load_settled

H200_BF16_DENSE_TFLOPS = 989.0
GB = 1e9


def measure(config: str, overrides: list[str], steps: int, model_root: Path, peak_tflops: float) -> dict[str, Any]:
    """One recipe in this process (see the module docstring)."""
    import msgspec
    import torch

    from roles.trainer.fsdp_engine import FSDPEngine
    from roles.weights.layout import BucketPacker
    from runtime.memory.plan import build_plan
    from runtime.tiny.model import make_tiny_model

    make_batch = _trainer_benchmark().make_batch

    path, *own = config.split("@")
    cuda = torch.cuda.is_available()
    cfg = load_settled(path, [*overrides, *own, f"trainer.device={'cuda' if cuda else 'cpu'}"])
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    total_gb = torch.cuda.get_device_properties(device).total_memory / GB if cuda else 0.0

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def allocated(peak: bool = False) -> float:
        if not cuda:
            return 0.0
        return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / GB

    def release() -> None:
        if cuda:
            torch.cuda.empty_cache()

    plan = build_plan(cfg, total_gb, 0.0, on_gpus=True)
    trainer0 = next((p for g in plan.gpus for p in g.processes if p.name == "trainer-0"), None)  # None on CPU
    made = time.perf_counter()
    model_dir = make_tiny_model(model_root / cfg.name, **msgspec.structs.asdict(cfg.model.tiny))
    made = time.perf_counter() - made
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_trainer_benchmark()._free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    built = time.perf_counter()
    engine = FSDPEngine(cfg, model_dir)
    built = time.perf_counter() - built
    length = cfg.data.synthetic_prompt_len + cfg.rollout.max_tokens
    lengths = [length] * (cfg.trainer.prompts_per_step * cfg.rollout.n)
    batch = make_batch(lengths, plan.shape.vocab)
    n = plan.shape.num_params
    packer = BucketPacker(device, cfg.weight_sync.bucket_mb << 20)
    at_optimizer: dict[str, float] = {}
    step_optimizer = engine.optimizer.step

    def probed_step(*args: Any, **kwargs: Any) -> Any:  # where in the step the peak falls
        at_optimizer.update(enter_gb=allocated(), peak_before_gb=allocated(peak=True))
        return step_optimizer(*args, **kwargs)

    engine.optimizer.step = probed_step  # type: ignore[method-assign]
    out: dict[str, Any] = {
        "config": config,
        "overrides": overrides,
        "params": n,
        "gpu_gb": total_gb,
        "model_make_s": made,
        "engine_build_s": built,
        "steps": [],
    }
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        m = engine.train_step(batch)
        sync()
        seconds = time.perf_counter() - t0
        record = {
            "step": step + 1,
            "seconds": seconds,
            "loss": m["loss"],
            "peak_gb": allocated(peak=True),
            "mfu": 6 * n * sum(lengths) / seconds / (peak_tflops * 1e12),
            "optimizer_offload_s": m.get("optimizer_offload_s"),
            "params_restore_s": m.get("params_restore_s"),
            "allocated_at_optimizer_gb": at_optimizer.get("enter_gb"),
            "peak_before_optimizer_gb": at_optimizer.get("peak_before_gb"),
        }
        release()
        t1 = time.perf_counter()
        for bucket in packer.buckets(engine.export_weights(torch.bfloat16)):
            del bucket
        sync()
        record["export_s"] = time.perf_counter() - t1
        record["peak_after_export_gb"] = allocated(peak=True)
        if engine.params_home is not None:
            before = [_local(p).clone().cpu() for p in engine.model.parameters()][:4]
            engine.offload_params()
            release()
            record["params_offload_s"] = engine.params_home.last_s
            record["allocated_offloaded_gb"] = allocated()
            engine.restore_params()
            after = [_local(p).cpu() for p in engine.model.parameters()][:4]
            record["params_back_bit_exact"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        release()
        record["resident_gb"] = allocated()
        out["steps"].append(record)
    peak = max(s["peak_after_export_gb"] for s in out["steps"])
    out.update(
        peak_gb=peak,
        reserved_gb=torch.cuda.max_memory_reserved(device) / GB if cuda else 0.0,
        resident_gb=out["steps"][-1]["resident_gb"],
    )
    if trainer0 is not None:
        out.update(
            plan_peak_gb=trainer0.trainer_peak,
            estimate_over_measured=trainer0.trainer_peak / peak,
            plan_resident_gb=trainer0.held("always"),
            plan_items={i.what: round(i.gb, 3) for i in trainer0.items},
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every config")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model-root", type=Path, default=Path("/tmp/tandem_memory_plan_models"))
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # the child: one config, JSON on stdout
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.set, args.steps, args.model_root, args.peak_tflops)))
        return 0
    results = []
    for config in args.config:  # each in a fresh process: the allocator's peaks are its own
        cmd = [
            sys.executable,
            __file__,
            "--config",
            config,
            "--one",
            config,
            "--steps",
            str(args.steps),
            "--model-root",
            str(args.model_root),
            "--peak-tflops",
            str(args.peak_tflops),
        ]
        for s in args.set:
            cmd += ["--set", s]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
        else:
            results.append({"config": config, "error": (proc.stderr or proc.stdout)[-3000:]})
        print(json.dumps(results[-1]), flush=True)
    out = {"results": results, **provenance()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
    return 0


def _trainer_benchmark() -> Any:
    """benchmarks/trainer.py as a module (its batch maker), without putting benchmarks/ on
    the path (its transport.py would shadow the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tandem_bench_trainer", Path(__file__).with_name("trainer.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _local(p: Any) -> Any:
    """A parameter's local shard (FSDP2 parameters are DTensors)."""
    return p.detach().to_local() if hasattr(p, "to_local") else p.detach()


if __name__ == "__main__":
    raise SystemExit(main())
