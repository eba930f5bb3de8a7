"""Scaling curves of async vs sync PPO: one axis per invocation. Prints one JSON object.

`--axis model`: the policy's size, in the bench shapes of configs/bench_{1.5b,3b,7b}.yaml (random
weights in a real model's shape, vLLM rollout and a 1-rank FSDP2 trainer on GPU 0, the
GPU-dependent settings `auto`: chosen by the memory plan for the GPU each point runs on):

* 0.5b: bench_1.5b.yaml with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads,
  2 KV heads, MLP 4864, vocabulary 151936, tied embeddings) as `model.tiny` overrides;
* 1.5b: bench_1.5b.yaml (Qwen2.5-1.5B's shape); 3b: bench_3b.yaml; 7b: bench_7b.yaml.

`--axis length`: the mean response length (512, 2k, 8k) on the 1.5b point, with heavy-tailed
budgets (`rollout.length_dist`: log-normal, `--sigma`, capped at 4x the mean; `ignore_eos`
so every sample runs to its budget); the engine's `max_model_len`, the model's positions and
the trainer's micro-batch grow to hold the cap.

Each point runs sync (`max_staleness=0`) and async (`--staleness`) through
benchmarks/async_vs_sync.py's code (the same summary: samples/s, `trainer_mfu`,
`weight_sync_s` over the steady steps; `speedup`, `speedup_tokens` and
`async_dropped_stale_fraction` as there: with long responses an async run drops the groups
that outlast max_staleness steps, so read the samples/s ratio with the other two), after
the launch-time memory plan (runtime/memory/plan.py, what `tandem launch --plan` shows)
has accepted it on this machine's GPUs: a point it refuses is recorded with the refusal (`refused`) and not run.
`--points tiny` puts both axes on configs/tiny_cpu.yaml at a tiny scale (two model shapes,
mean lengths 8 and 16) for a CPU smoke test. The plot is a page of the project's report
tooling (plotly panels, runtime/views/report/page.py) and its PNG screenshot (headless Chromium,
runtime/views/report/browser.py): `--plot DIR` writes `scaling_AXIS.html` and `scaling_AXIS.png`.
`--gpus 0,1` runs the points side by side, each point's sync and async runs on one GPU
(benchmarks/gpu_slots.py; each point in the JSON names its `gpu`).
`--import POINT=FILE` takes a point from a result of benchmarks/async_vs_sync.py that measured
exactly what the point would run (same config, overrides including `--steps`, staleness,
warm-up and measured steps, with `measured_at` and `commit`): the figures are its two runs'
and its headline's, and the point records `imported_from`; anything else is refused naming
the field. It saves re-running a point a section of BENCHMARKS.md already measured; results
recorded under the recipes' old names (bench_h200x1*.yaml, H200 settings pinned) are refused.
`--no-run` runs nothing and writes (and with `--plot` draws) what `--add-to` and `--import`
give, e.g. to draw on a machine with Chromium a curve measured on one without.
`--add-to FILE` builds a curve over several sittings: the points of an earlier JSON of the
same axis, scale, staleness, warm-up, steps, sigma and overrides are kept, except those run
now (`--only`), which replace them; the result lists the axis's points in order. Each point
records `measured_at`, `host` and `commit` (as benchmarks/async_vs_sync.py): its sync and
async runs share one machine, so its ratio is like for like; samples/s across points from
different machines are not.

    .venv/bin/python benchmarks/scaling.py --axis model --out benchmarks/results/scaling_model_h200x1.json \\
        --plot benchmarks/results [--steps 12] [--gpus 0,1] [--only 3b --add-to EARLIER.json] \\
        [--import 7b=ASYNC_VS_SYNC_7B.json] [key=value ...]
    .venv/bin/python benchmarks/scaling.py --axis length --points tiny --steps 2 --warmup-steps 1   # CPU
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.async_vs_sync import (
    H200_BF16_DENSE_TFLOPS,
    compare,
    emit,
    run_variant,
    setup_policy,
    variant_overrides,
)
from benchmarks.gpu_slots import Job, check_one_gpu, parse_gpus, run_spread
from benchmarks.json_out import provenance, read_earlier
from runtime.config import RunConfig
from runtime.errors import ConfigError
from runtime.memory.auto import load_settled
from runtime.preflight.environment import check_launch

ROOT = Path(__file__).resolve().parent.parent
QWEN_05B = [
    "model.tiny.hidden_size=896",
    "model.tiny.num_layers=24",
    "model.tiny.num_heads=14",
    "model.tiny.num_kv_heads=2",
    "model.tiny.intermediate_size=4864",
    "model.tiny.vocab_size=151936",
    "model.tiny.tie_word_embeddings=true",
]
CAP_OVER_MEAN = 4  # the length axis caps each budget at 4x its mean
PROMPT_ROOM = 128  # tokens of max_model_len kept for the prompt on the length axis
FIGURES = ("samples_per_s", "trainer_mfu", "weight_sync_s")
HEADLINE = ("speedup", "speedup_tokens", "async_dropped_stale_fraction")  # async_vs_sync's compare()


@dataclass
class Point:
    """One point of a curve: a config and its overrides; `x` is its value on the axis."""

    name: str
    x: float
    config: str
    overrides: list[str] = field(default_factory=list)


def length_overrides(mean: int, sigma: float, max_model_len: int, micro_batch_tokens: int) -> list[str]:
    """Budgets log-normal around `mean`, capped at CAP_OVER_MEAN x mean, and room for the cap
    beside a prompt (PROMPT_ROOM tokens: the synthetic prompts with their template are shorter)."""
    cap = CAP_OVER_MEAN * mean
    room = max(max_model_len, PROMPT_ROOM + cap)
    return [
        "rollout.ignore_eos=true",
        f"rollout.max_tokens={cap}",
        "rollout.length_dist.kind=lognormal",
        f"rollout.length_dist.mean_tokens={mean}",
        f"rollout.length_dist.sigma={sigma}",
        f"rollout.length_dist.min_tokens={max(1, mean // 32)}",
        f"rollout.engine.max_model_len={room}",
        f"model.tiny.max_position_embeddings={max(1024, room)}",
        f"trainer.micro_batch_tokens={max(micro_batch_tokens, room)}",
    ]


def points(axis: str, scale: str, sigma: float) -> list[Point]:
    """The points of `axis` at `scale` (`h200`: the bench shapes; `tiny`: tiny_cpu.yaml)."""
    if scale == "tiny":
        tiny = "configs/tiny_cpu.yaml"
        if axis == "model":
            return [Point("tiny-128", 128, tiny), Point("tiny-256", 256, tiny, ["model.tiny.hidden_size=256"])]
        return [Point(f"mean-{m}", m, tiny, length_overrides(m, sigma, 256, 4096)) for m in (8, 16)]
    bench = "configs/bench_1.5b.yaml"
    if axis == "model":
        return [
            Point("0.5b", 0.5, bench, QWEN_05B),
            Point("1.5b", 1.5, bench),
            Point("3b", 3.0, "configs/bench_3b.yaml"),
            Point("7b", 7.0, "configs/bench_7b.yaml"),
        ]
    return [Point(f"mean-{m}", m, bench, length_overrides(m, sigma, 1024, 8192)) for m in (512, 2048, 8192)]


def refusal(cfg: RunConfig) -> str | None:
    """Why the launch would refuse `cfg` (the config checks, then the memory plan on this
    machine's GPUs, or `memory.gpu_gb`); None: it fits."""
    from runtime.config.placement import entries
    from runtime.memory.plan import check_plan, launch_plan

    try:
        check_launch(cfg)
        check_plan(cfg, launch_plan(cfg, asks_gpus=any(e.devices for e in entries(cfg))))
    except ConfigError as exc:
        return str(exc)
    return None


def run_point(
    point: Point, args: argparse.Namespace, run_root: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Sync and async at one point (`env` added to their launches' environment), or why the
    memory plan refuses it."""
    config = (ROOT / point.config).resolve()
    base_overrides = point_base_overrides(point, args)
    base = load_settled(config, base_overrides)
    plans = variant_overrides(base, args.staleness, None)
    out: dict[str, Any] = {"point": point.name, "x": point.x, "config": point.config, "overrides": base_overrides}
    for extra in plans.values():
        why = refusal(load_settled(config, [*base_overrides, *extra]))
        if why is not None:
            return {**out, "refused": why, "variants": {}}
    root = run_root / point.name
    root.mkdir(parents=True, exist_ok=True)
    policy = setup_policy(base, root)
    variants = {}
    for name, extra in plans.items():
        overrides = [
            *base_overrides,
            *policy.overrides,
            f"name={config.stem}-{point.name}-{name}",
            f"run_dir={root / name}",
            *extra,
        ]
        variants[name] = run_variant(config, overrides, args, policy, env=env)
    figures = {f"{name}_{k}": v.get(k) for name, v in variants.items() for k in FIGURES}
    headline = {k: v for k, v in compare(variants, None).items() if k in HEADLINE}
    return {
        **out,
        **provenance(),
        "params": policy.params,
        **figures,
        **headline,
        "refused": None,
        "variants": variants,
    }


def point_base_overrides(point: Point, args: argparse.Namespace) -> list[str]:
    """The overrides every run of `point` gets (before the variant's own): the point's, the
    command line's, and `trainer.total_steps` where `--steps` sets it."""
    return [*point.overrides, *args.overrides, *(["trainer.total_steps=" + str(args.steps)] * bool(args.steps))]


def imported_point(point: Point, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`point` from `path`, a result of benchmarks/async_vs_sync.py that measured exactly what
    run_point would (its config, overrides, staleness, warm-up and number of steps; `measured_at`
    and `commit` recorded): the same figures, taken from its two runs and its headline, and
    `imported_from`. One measured otherwise is refused with a one-line reason naming the field."""

    option = f"--import {point.name}={path}"

    def refuse(why: str) -> SystemExit:
        return SystemExit(f"scaling: {option}: {why}")

    want = {
        "config": point.config,
        "overrides": point_base_overrides(point, args),
        "staleness": args.staleness,
        "warmup_steps": args.warmup_steps,
    }
    old = read_earlier(path, "async_vs_sync", "variants", want, asker="scaling", option=option)
    for key in ("measured_at", "commit"):
        if not old.get(key):
            raise refuse(f"it records no {key} (where and when it ran must be known)")
    variants = old.get("variants")
    if not isinstance(variants, dict) or set(variants) != {"sync", "async"}:
        raise refuse("its variants are not one sync and one async run")
    total = load_settled(ROOT / point.config, want["overrides"]).trainer.total_steps
    measured = variants["sync"].get("steps")  # a point's sync run measures every step after the warm-up
    if measured != total - args.warmup_steps:
        raise refuse(
            f"its sync run measured {measured} steps, this point's would measure {total - args.warmup_steps} "
            f"(trainer.total_steps {total} less {args.warmup_steps} warm-up)"
        )
    figures = {f"{name}_{k}": v.get(k) for name, v in variants.items() for k in FIGURES}
    headline = {k: old.get(k) for k in HEADLINE}  # as the file has them (older results lack speedup_tokens)
    stamp: dict[str, Any] = {k: old[k] for k in ("measured_at", "host", "commit", "provenance_note") if k in old}
    return {
        "point": point.name,
        "x": point.x,
        "config": point.config,
        "overrides": want["overrides"],
        **stamp,
        "params": old.get("params"),
        **figures,
        **headline,
        "refused": None,
        "variants": variants,
        "imported_from": str(path),
    }


def point_job(point: Point, args: argparse.Namespace, run_root: Path) -> Job[dict[str, Any]]:
    return lambda env: run_point(point, args, run_root, env)


SAME_AS_EARLIER = ("axis", "scale", "staleness", "warmup_steps", "steps", "sigma", "overrides")


def earlier_points(path: Path, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The points of `path`, an earlier JSON of this benchmark measured as `result` says (its
    SAME_AS_EARLIER fields); one measured otherwise is refused, naming the first field that differs."""
    old = read_earlier(path, "scaling", "points", {key: result[key] for key in SAME_AS_EARLIER})
    if not isinstance(old["points"], list):
        raise SystemExit(f"scaling: --add-to {path}: not a result of benchmarks/scaling.py")
    return old["points"]


def merged(order: list[Point], earlier: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The axis's points in `order`: each one run now, else its earlier result, else left out."""
    found = {p["point"]: p for p in earlier} | {p["point"]: p for p in new}
    return [found[pt.name] for pt in order if pt.name in found]


def plot(result: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """The curves as a report page (plotly) and its PNG; the paths written (no PNG without Chromium)."""
    import plotly.graph_objects as go

    from runtime.views.report.browser import find_chromium, screenshot
    from runtime.views.report.page import render

    ran = [p for p in result["points"] if not p["refused"]]
    panels = {}
    for key, title in (
        ("samples_per_s", "samples/s"),
        ("trainer_mfu", "trainer MFU"),
        ("weight_sync_s", "weight sync (s)"),
    ):
        fig = go.Figure()
        for variant in ("sync", "async"):
            fig.add_trace(
                go.Scatter(
                    x=[p["x"] for p in ran],
                    y=[p.get(f"{variant}_{key}") for p in ran],
                    mode="lines+markers",
                    name=variant,
                )
            )
        fig.update_layout(title=f"{title} vs {result['axis']}", xaxis_title=result["x_label"], height=360)
        if result["axis"] == "length":
            fig.update_xaxes(type="log")
        panels[key] = fig
    rows = [
        {
            "point": p["point"],
            "speedup": _fmt(p.get("speedup")),
            "speedup (tokens)": _fmt(p.get("speedup_tokens")),
            "async dropped stale": _fmt(p.get("async_dropped_stale_fraction")),
            "sync samples/s": _fmt(p.get("sync_samples_per_s")),
            "async samples/s": _fmt(p.get("async_samples_per_s")),
            "refused": p["refused"] or "",
        }
        for p in result["points"]
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    page = out_dir / f"scaling_{result['axis']}.html"
    page.write_text(render(f"scaling: {result['axis']}", rows, {}, panels))
    written = {"html": str(page)}
    if find_chromium() is not None:
        written["png"] = str(screenshot(page, out_dir / f"scaling_{result['axis']}.png", width=1200, height=1500))
    return written


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.3g}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every point")
    p.add_argument("--axis", choices=["model", "length"], required=True)
    p.add_argument("--points", choices=["h200", "tiny"], default="h200", help="tiny: CPU smoke scale")
    p.add_argument("--only", action="append", help="run only this point (repeatable), e.g. 0.5b or mean-2048")
    p.add_argument("--steps", type=int, default=0, help="trainer.total_steps of every run (0: the config's)")
    p.add_argument("--staleness", type=int, default=2, help="rollout.max_staleness of the async runs")
    p.add_argument("--sigma", type=float, default=1.0, help="length axis: rollout.length_dist.sigma")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="per trainer GPU")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    p.add_argument("--run-root", type=Path, help="default: runs/scaling/AXIS-<time>")
    p.add_argument("--plot", type=Path, help="write scaling_AXIS.html and .png here")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--gpus", type=parse_gpus, help="run the points side by side on these GPUs (e.g. 0,1)")
    p.add_argument("--add-to", type=Path, metavar="FILE", help="an earlier JSON of this axis: keep its other points")
    p.add_argument("--no-run", action="store_true", help="run no point: keep --add-to's and --import's (and --plot)")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="POINT=FILE",
        help="take POINT from an async_vs_sync.py result that measured exactly it (repeatable)",
    )
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> None:
    import time

    args = parse_args(argv)
    axis_points = {pt.name: pt for pt in points(args.axis, args.points, args.sigma)}
    imports: dict[str, Path] = {}
    for item in args.imports:
        name, _, path = item.partition("=")
        if name not in axis_points or not path:
            raise SystemExit(f"scaling: --import {item}: give POINT=FILE with POINT one of {', '.join(axis_points)}")
        imports[name] = Path(path)
    imported = [imported_point(axis_points[name], path, args) for name, path in imports.items()]
    chosen = [pt for pt in axis_points.values() if (not args.only or pt.name in args.only) and pt.name not in imports]
    if args.no_run:
        if args.only or not (args.add_to or imported):
            raise SystemExit("scaling: --no-run takes no --only, and needs --add-to or --import (the points to keep)")
        chosen = []
    elif not chosen and not imported:
        raise SystemExit(f"scaling: no point named {args.only} on axis {args.axis} ({args.points})")
    if args.gpus:
        for pt in chosen:
            try:
                check_one_gpu(load_settled(ROOT / pt.config, [*pt.overrides, *args.overrides]), pt.config)
            except ValueError as exc:
                raise SystemExit(f"scaling: {exc}") from None
    run_root = (args.run_root or ROOT / "runs" / "scaling" / f"{args.axis}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    label = {"model": "parameters (billions; tiny: hidden size)", "length": "mean response tokens"}[args.axis]
    result: dict[str, Any] = {
        "benchmark": "scaling",
        "axis": args.axis,
        "scale": args.points,
        "x_label": label,
        "staleness": args.staleness,
        "warmup_steps": args.warmup_steps,
        "steps": args.steps,
        "sigma": args.sigma,
        "overrides": args.overrides,
        "run_root": str(run_root),
        "gpus": args.gpus,
    }
    earlier = earlier_points(args.add_to, result) if args.add_to else []
    jobs = [point_job(pt, args, run_root) for pt in chosen]
    ran = [{**point, "gpu": gpu} for point, gpu in run_spread(jobs, args.gpus)]
    result["points"] = merged(list(axis_points.values()), earlier, [*imported, *ran])
    if args.plot:
        result["plot"] = plot(result, args.plot)
    emit(result, args.out)


if __name__ == "__main__":
    main()
