"""On-policy distillation's cost: one recipe with its teacher role and the same recipe without
one, in one invocation, as separate `tandem launch` runs. Prints one JSON object.

Variants, each into its own run directory under `--run-root`, in this order:

* `no_teacher`: `algorithm.distill.teacher` unset and the teacher's placement entry removed
  (the task reward's advantage alone), everything else as the recipe says (`auto` settings
  chosen for the GPU without the teacher's memory);
* `teacher`: the recipe as it stands: the teacher scores every group while the rollout
  generates and the trainer trains.

Each run keeps `--measured-steps` steps (default 10) after `--warmup-steps` (2) and before its
last max_staleness steps (async_vs_sync.py's window and summary). `teacher_over_no_teacher`
is the teacher run's samples/s over the other's: 1.0 means the teacher's scoring is wholly
hidden behind generation and training; `hidden` says whether it is at least 0.85. The
teacher run also reports its teacher's figures over the window: `teacher_wait_s_median` (how
long after a batch's last sample its last teacher answer came), `teacher_tokens_per_s_median`
(tokens scored per second the teacher was busy), `teacher_failures`, and `distill_kl` of its
first and last measured steps. A tiny teacher (`teacher: tiny`) is made once under the run root.

`--only NAME` runs one variant (then no ratio); `--reuse` summarises, instead of running again,
a variant whose run directory under `--run-root` already holds a finished run. So a GPU command
with a time limit can run `--only teacher` and a later one, same `--run-root`, `--reuse` the
rest. Each variant's start and end go to stderr as one line each (the JSON comes at the end).

    python3 benchmarks/distill.py --config configs/distill_1.5b.yaml [key=value ...]
        [--out benchmarks/results/distill_h100x1.json] [--only teacher] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.async_vs_sync import (
    H200_BF16_DENSE_TFLOPS,
    ROOT,
    read_metrics,
    run_variant,
    setup_policy,
    steps_override,
)
from benchmarks.json_out import print_json, provenance
from runtime.config import RunConfig
from runtime.config.placement import entries
from runtime.memory.auto import load_settled
from runtime.preflight.environment import check_launch

HIDDEN_AT = 0.85  # the teacher counts as hidden when throughput with it is this fraction of without
VARIANTS = ("no_teacher", "teacher")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both variants")
    parser.add_argument("--config", default="configs/distill_1.5b.yaml")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--measured-steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="per trainer GPU")
    parser.add_argument("--run-root", type=Path, help="default: runs/distill/<config>-<time>")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per variant")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--only", choices=VARIANTS, help="run only this variant (then no ratio)")
    parser.add_argument("--reuse", action="store_true", help="summarise variants already finished under --run-root")
    return parser.parse_intermixed_args(argv)


def no_teacher_placement(cfg: RunConfig) -> str:
    """The placement without its teacher entries, as one `placement=[...]` override."""
    kept = [e for e in entries(cfg) if e.role != "teacher"]
    return "placement=" + json.dumps([{k: v for k, v in _entry(e).items() if v not in ([], {})} for e in kept])


def _entry(e: Any) -> dict[str, Any]:
    return {"role": e.role, "count": e.count, "devices": list(e.devices), "env": dict(e.env), "node": e.node}


def teacher_overrides(cfg: RunConfig, run_root: Path) -> list[str]:
    """A tiny teacher made once under `run_root` (none for a given teacher directory)."""
    d = cfg.algorithm.distill
    if d.teacher != "tiny":
        return []
    import msgspec

    from runtime.tiny.teacher import make_tiny_teacher

    path = make_tiny_teacher(run_root / "teacher_model", msgspec.structs.asdict(d.tiny), d.tiny_train_steps)
    return [f"algorithm.distill.teacher={path}"]


def teacher_figures(run_dir: Path, warmup: int, measured: int) -> dict[str, Any]:
    """The teacher's figures over the measured window of a run (module docstring)."""
    kept = read_metrics(run_dir / "metrics.jsonl")[warmup : warmup + measured]
    waits = [r["teacher_wait_s"] for r in kept if "teacher_wait_s" in r]
    rates = [r["teacher_tokens_per_s"] for r in kept if "teacher_tokens_per_s" in r]
    kl = [r["distill_kl"] for r in kept if "distill_kl" in r]
    return {
        "teacher_wait_s_median": statistics.median(waits) if waits else None,
        "teacher_tokens_per_s_median": statistics.median(rates) if rates else None,
        "teacher_failures": sum(r.get("teacher_failures", 0.0) for r in kept),
        "distill_kl_first": kl[0] if kl else None,
        "distill_kl_last": kl[-1] if kl else None,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = Path(args.config).resolve()
    base = load_settled(config, args.overrides)
    if not base.algorithm.distill.enabled:
        raise SystemExit(f"distill: {config.name} sets no algorithm.distill.teacher")
    run_root = (
        args.run_root or ROOT / "runs" / "distill" / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    ).resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    policy = setup_policy(base, run_root)
    steps = steps_override(base, args.warmup_steps, args.measured_steps)
    wanted = [args.only] if args.only else list(VARIANTS)
    variants_overrides = {
        "no_teacher": lambda: ["algorithm.distill.teacher=", no_teacher_placement(base)],
        "teacher": lambda: teacher_overrides(base, run_root),
    }
    runs = {}
    for name in wanted:
        runs[name] = [*args.overrides, *policy.overrides, f"name={config.stem}-{name}", f"run_dir={run_root / name}"]
        runs[name] += [*variants_overrides[name](), *steps]
        check_launch(load_settled(config, runs[name]))  # every variant checked before any runs
    variants = {}
    for name, overrides in runs.items():
        print(f"distill: {name}: starting, {run_root / name}", file=sys.stderr, flush=True)
        variants[name] = run_variant(config, overrides, args, policy, reuse=args.reuse)
        print(f"distill: {name}: {variants[name]['samples_per_s']:.2f} samples/s", file=sys.stderr, flush=True)
    if "teacher" in variants:
        variants["teacher"].update(teacher_figures(run_root / "teacher", args.warmup_steps, args.measured_steps))
    ratio = (
        variants["teacher"]["samples_per_s"] / variants["no_teacher"]["samples_per_s"] if len(variants) == 2 else None
    )
    result = {
        "benchmark": "distill",
        "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
        "overrides": args.overrides,
        "warmup_steps": args.warmup_steps,
        "measured_steps": args.measured_steps,
        "params": policy.params,
        "run_root": str(run_root),
        **provenance(),
        "teacher_over_no_teacher": ratio,
        "hidden": None if ratio is None else ratio >= HIDDEN_AT,
        "variants": variants,
    }
    print_json(result, args.out)


if __name__ == "__main__":
    main()
