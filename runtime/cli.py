"""The `tandem` command. Heavy modules are imported only by the subcommand that needs
them, so a config error is reported before torch or vLLM is ever imported."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import RunConfig


def _version() -> str:
    try:
        return version("tandem-rl")
    except PackageNotFoundError:
        return "0+unknown"


LAUNCH_EPILOG = """\
the run directory, run_dir=DIR (default runs/<name>), belongs to one run: a
second launch into it is refused unless it says
  resume=auto     continue from the newest intact checkpoint there
  resume=fresh    move the earlier run to DIR/earlier/<time>/ and start over

examples:
  tandem launch configs/tiny_cpu.yaml trainer.total_steps=5 run_dir=runs/try
  tandem launch configs/tiny_cpu.yaml run_dir=runs/try resume=auto
  tandem launch configs/grpo_gsm8k.yaml model.path=/models/Qwen2.5-1.5B
  tandem launch --plan configs/bench_1.5b.yaml memory.gpu_gb=80"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous RL post-training runtime.")
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser(
        "launch",
        help="run a config on this node",
        epilog=LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("config", help="YAML recipe, e.g. configs/tiny_cpu.yaml")
    launch.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help=(
            "dotted config overrides (every key: tandem config-docs), e.g. trainer.total_steps=5, "
            "run_dir=DIR (default runs/NAME), resume=auto|fresh"
        ),
    )
    launch.add_argument("--nnodes", type=int, default=None, help="nodes in the run (default: Slurm's or 1)")
    launch.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: Slurm's or 0)")
    launch.add_argument("--master-addr", default=None, help="node 0's address (controller, torch rendezvous)")
    launch.add_argument("--master-port", type=int, default=None, help="base port on node 0 (default 29500)")
    launch.add_argument("--join", default="", metavar="HOST:PORT", help="join a running job with rollout roles only")
    launch.add_argument("--quiet", action="store_true", help="print errors only (to stderr): for scripts")
    launch.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (defaults filled in, overrides applied) as YAML and exit",
    )
    launch.add_argument(
        "--plan",
        action="store_true",
        help=(
            "print the memory plan of every GPU and host and exit (0: it fits, 2: it does not); "
            "memory.gpu_gb=N plans for N-GB GPUs on a machine without them"
        ),
    )

    tail = sub.add_parser("tail", help="merge and follow a run's logs")
    from runtime.views.tail import add_tail_arguments

    add_tail_arguments(tail)

    watch = sub.add_parser("watch", help="live terminal view of a run (q or Ctrl-C quits)")
    from runtime.views.watch import add_watch_arguments

    add_watch_arguments(watch)

    report = sub.add_parser("report", help="write an HTML report (curves, schedule timeline) of a run")
    report.add_argument("run_dir")
    report.add_argument("-o", "--output", default=None, metavar="FILE.html", help="default: RUN_DIR/report.html")
    report.add_argument("--png", default=None, metavar="DIR", help="also write DIR/report.png (headless Chromium)")
    report.add_argument("--compare", default=None, metavar="RUN_DIR2", help="overlay a second run (e.g. sync)")

    docs = sub.add_parser("config-docs", help="print the config reference (markdown)")
    docs.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated text")

    export = sub.add_parser("export", help="write a checkpoint's policy (HF directory; LoRA: the adapter, or --merge)")
    export.add_argument("run_dir")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest complete)")
    export.add_argument(
        "--merge", action="store_true", help="LoRA runs: merge the adapter into the base model (default: the adapter)"
    )
    export.add_argument("out_dir")

    keys = sub.add_parser("keys", help="generate CurveZMQ keys for a cross-host run")
    keys.add_argument("run_dir")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "launch" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # `launch CONFIG --plan key=value`: overrides after a flag are overrides too
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler = {
        "launch": _launch,
        "tail": _tail,
        "report": _report,
        "watch": _watch,
        "config-docs": _docs,
        "export": _export,
        "keys": _keys,
    }
    code = handler[args.command](args)
    if args.command == "launch" and "torch" in sys.modules:
        # Every role is reaped and the logs are flushed: skip the interpreter's final
        # garbage collection of torch and transformers, seconds on a 2-core machine.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def _launch(args: argparse.Namespace) -> int:
    from runtime.config.load import check_set
    from runtime.errors import ConfigError
    from runtime.memory.auto import load_settled

    try:
        cfg = load_settled(args.config, args.overrides)  # `auto` settled for this machine
    except ConfigError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:  # what RUN_DIR/config.yaml would hold; nothing is checked, made or started
        from runtime.config.load import to_yaml

        sys.stdout.write(to_yaml(cfg))
        return 0
    from runtime.launch.multinode import resolve_launch_options

    try:
        check_set(cfg, args.config)
        opts = resolve_launch_options(args, os.environ)
    except ValueError as exc:  # a ConfigError too
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    from runtime.data.inputs import check_inputs
    from runtime.launch.placement import PlacementError
    from runtime.preflight.environment import check_launch

    try:
        check_launch(cfg)  # before the launcher (and torch) is imported: a bad input fails in well under 2 s
        check_inputs(cfg)
        if args.plan:
            return _plan(cfg, args)
        from runtime.launch.launcher import launch

        return launch(cfg, opts, quiet=args.quiet)
    except (PlacementError, ConfigError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


def _plan(cfg: RunConfig, args: argparse.Namespace) -> int:
    from runtime.config.placement import wants_gpus
    from runtime.memory.estimate import ShapeError
    from runtime.memory.plan import check_plan, format_plan, launch_plan

    try:
        plan = launch_plan(cfg, asks_gpus=wants_gpus(cfg))
    except ShapeError as exc:
        print(f"tandem: error: no memory plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if plan.gpus and not plan.gpu_gb:  # planned for GPUs of no known size: nothing above was checked
        print(_gpu_it_needs(args.config, args.overrides))
    check_plan(cfg, plan)  # a ConfigError: one line, exit 2
    return 0


# The usual GPUs, with their memory as nvidia-smi reports it, in GB (10^9 bytes) as the plan counts.
USUAL_GPUS = (
    ("24 GB (L4)", 24.1),
    ("40 GB (A100 40GB)", 42.9),
    ("48 GB (L40S)", 48.3),
    ("80 GB (H100, A100 80GB)", 85.5),
    ("94 GB (H100 NVL)", 100.5),
    ("141 GB (H200)", 150.1),
)


def _gpu_it_needs(config: str, overrides: list[str]) -> str:
    """The smallest usual GPU the run fits (with what `auto` chooses for its size), as the
    note under a plan made without a GPU size, and the command that shows its plan."""
    from runtime.config.placement import wants_gpus
    from runtime.errors import ConfigError
    from runtime.memory.auto import load_settled
    from runtime.memory.estimate import ShapeError
    from runtime.memory.plan import GPU_HEADROOM_GB, launch_plan

    head = "note: no GPU size is known here (no GPU, no memory.gpu_gb), so vLLM's share is 0 and nothing is checked"
    for name, size in USUAL_GPUS:
        try:
            cfg = load_settled(config, [*overrides, f"memory.gpu_gb={size}"])
            plan = launch_plan(cfg, asks_gpus=wants_gpus(cfg))
        except (ConfigError, ShapeError):
            continue
        if all(need <= size - GPU_HEADROOM_GB for g in plan.gpus for need in g.phases().values()):
            command = shlex.join(["tandem", "launch", "--plan", config, *overrides, f"memory.gpu_gb={size}"])
            return (
                f"{head}; it needs {name} GPUs ({size} GB), the smallest usual ones it fits: {command} shows that plan"
            )
    return (
        f"{head}; it fits no usual GPU as placed, up to {USUAL_GPUS[-1][0]}: place the roles on more GPUs "
        "(memory.gpu_gb=N plans for N GB)"
    )


def _tail(args: argparse.Namespace) -> int:
    from runtime.views.tail import run_tail

    return run_tail(args)


def _watch(args: argparse.Namespace) -> int:
    from runtime.views.watch import run_watch

    return run_watch(args)


def _report(args: argparse.Namespace) -> int:
    from runtime.views.report.build import build_report

    try:
        path = build_report(args.run_dir, args.output, compare=args.compare, png_dir=args.png)
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    print(f"tandem: wrote {path}" + (f" and {args.png}/report.png" if args.png else ""))
    return 0


def _docs(args: argparse.Namespace) -> int:
    from runtime.config.load import config_docs

    text = config_docs()
    if args.check:
        with open(args.check) as f:
            if f.read() != text:
                print(
                    f"tandem: error: {args.check} is out of date; run `tandem config-docs > {args.check}`",
                    file=sys.stderr,
                )
                return 1
        return 0
    sys.stdout.write(text)
    return 0


def _export(args: argparse.Namespace) -> int:
    from runtime.checkpoints.export import export_checkpoint

    try:
        path = export_checkpoint(args.run_dir, args.step, args.out_dir, merge=args.merge)
    except (FileNotFoundError, ValueError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    print(f"tandem: wrote {path}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from pathlib import Path

    from runtime.identity.run_token import ensure_token
    from transport.security import generate_keys

    path = generate_keys(Path(args.run_dir) / "keys")
    ensure_token(args.run_dir)
    print(f"tandem: wrote CurveZMQ keys and the run token to {path}; copy this folder to every node's run directory")
    return 0


if __name__ == "__main__":
    main()
