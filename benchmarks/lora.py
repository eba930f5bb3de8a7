"""LoRA vs full fine-tuning on one config, back to back in one invocation. Prints one JSON object.

Two `tandem launch` runs of the same config and overrides, each into its own run directory
under `--run-root`: `lora` (`trainer.lora.rank=--rank`, `trainer.optim.lr` times
`--lr-scale`, as LoRA usually wants), then `full` (`trainer.lora.rank=0`). Both are async
(`rollout.max_staleness=--staleness`). Each is summarised over its steady window as
benchmarks/async_vs_sync.py does (warm-up and cool-down steps left out; rates are totals,
weight sync the median step), plus what LoRA changes: the bytes one update moves
(`weight_sync_gb`, median), and the trainer's peak GPU memory (`cuda_peak_gb`: torch's
`max_memory_allocated` on trainer rank 0 since its start, the last step's value; null on CPU).
Both run with the full variant's `auto` settings (micro-batch, vLLM's share, offload: what
runtime/memory/auto.py chose for it), so only LoRA differs. The JSON has both variants and the
ratios lora / full.

    python3 benchmarks/lora.py --config configs/bench_1.5b.yaml --out benchmarks/results/lora_h200x1.json \\
        trainer.total_steps=10
    .venv/bin/python benchmarks/lora.py --config configs/tiny_cpu.yaml trainer.total_steps=8   # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_vs_sync import H200_BF16_DENSE_TFLOPS, ROOT, Policy, emit, read_metrics, run_variant, setup_policy

from runtime.memory.auto import load_settled, pins
from runtime.preflight.environment import check_launch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both variants")
    parser.add_argument("--config", default="configs/bench_1.5b.yaml")
    parser.add_argument("--rank", type=int, default=16, help="trainer.lora.rank of the lora variant")
    parser.add_argument("--lr-scale", type=float, default=10.0, help="the lora variant's lr over the config's")
    parser.add_argument("--staleness", type=int, default=2, help="rollout.max_staleness of both variants")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="per trainer GPU")
    parser.add_argument("--run-root", type=Path, help="default: runs/lora/<config>-<time>")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per variant")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser.parse_intermixed_args(argv)


def variant(config: Path, overrides: list[str], args: argparse.Namespace, policy: Policy) -> dict[str, Any]:
    """async_vs_sync's summary of one run, plus the update's size and the trainer's peak memory."""
    summary = run_variant(config, overrides, args, policy)
    cfg = load_settled(config, overrides)
    records = sorted(read_metrics(Path(cfg.run_dir) / "metrics.jsonl"), key=lambda r: r["step"])
    kept = records[args.warmup_steps : len(records) - summary["cooldown_steps"]]
    peaks = [r["cuda_peak_gb"] for r in records if "cuda_peak_gb" in r]
    return {
        **summary,
        "update_gb": statistics.median(r["weight_sync_gb"] for r in kept),
        "trainer_peak_gb": peaks[-1] if peaks else None,
        "reward_last": records[-1]["reward_mean"],
        "lora_rank": cfg.trainer.lora.rank,
        "lr": cfg.trainer.optim.lr,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = Path(args.config).resolve()
    base = load_settled(config, args.overrides)
    run_root = (args.run_root or ROOT / "runs" / "lora" / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    policy = setup_policy(base, run_root)
    lr = base.trainer.optim.lr * args.lr_scale
    # LoRA first: on a machine where it cannot run, the benchmark fails before the long full run.
    extra = {"lora": [f"trainer.lora.rank={args.rank}", f"trainer.optim.lr={lr}"], "full": ["trainer.lora.rank=0"]}
    common = [*args.overrides, *policy.overrides, f"rollout.max_staleness={args.staleness}"]
    chosen = pins(load_settled(config, [*common, *extra["full"]]))  # the full run's `auto` settings, for both
    runs = {}
    for name, more in extra.items():
        runs[name] = [*common, *chosen, f"name={config.stem}-{name}", f"run_dir={run_root / name}", *more]
        check_launch(load_settled(config, runs[name]))  # a bad variant fails before any run starts
    variants = {n: variant(config, o, args, policy) for n, o in runs.items()}
    full, lora = variants["full"], variants["lora"]

    def ratio(key: str) -> float | None:
        a, b = lora.get(key), full.get(key)
        return a / b if a is not None and b else None

    result = {
        "benchmark": "lora",
        "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
        "overrides": args.overrides,
        "params": policy.params,
        "staleness": args.staleness,
        "warmup_steps": args.warmup_steps,
        "run_root": str(run_root),
        "lora_over_full": {k: ratio(k) for k in ("samples_per_s", "weight_sync_s", "update_gb", "trainer_peak_gb")},
        "variants": variants,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
