"""`tandem watch RUN_DIR`: a live terminal view of a run (rich; plain ANSI, so it works
over ssh): a table of the roles (alive, policy version, groups in flight, last log line),
the step rate and ETA, the last step's metrics, and sparklines of reward and throughput.

It redraws every `--interval` seconds and quits on `q` or Ctrl-C (exit 0), leaving the
terminal as it found it; `--once` prints one frame and exits (for scripts and pipes), and so
does a `tandem watch` whose output is not a terminal (`> file`, `| less`), saying so on stderr.
A NaN or infinite metric shows as `nan` / `inf` and leaves a gap in its sparkline."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from runtime.views.records import metric, skipped_warning
from runtime.views.wall_clock import clock, wall_label
from runtime.views.watch_state import RunState

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as block characters scaled between the min and max of the
    finite ones; a NaN or infinite value is a space."""
    values = values[-width:]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join(
        BARS[min(len(BARS) - 1, int((v - lo) / span * len(BARS)))] if math.isfinite(v) else " " for v in values
    )


def roles_table(state: RunState, now: float) -> Table:
    # Role names are never cut (at 80 columns they were: `controlle…`): two-line headers and
    # no vertical rules keep the table narrow, and an event too long for the rest folds.
    longest = max((len(name) for name in state.roles), default=4)
    table = Table(title="roles", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("role", no_wrap=True, min_width=longest)
    for col in ("alive", "state", "version", "in\nflight", "last\nlog"):
        table.add_column(col, no_wrap=True)
    table.add_column("last\nevent", overflow="fold")
    for name in sorted(state.roles, key=_role_order):
        st = state.roles[name]
        alive = st.alive()
        mark = "[green]yes[/]" if alive else "[red]no[/]" if alive is False else "?"
        flight = "-"
        if name in state.rollouts or name.startswith("rollout"):  # "?": no schedule.jsonl to count from
            flight = str(state.in_flight_of(name)) if state.has_schedule() else "?"
        ago = f"{clock(max(0.0, now - st.last_ts))} ago" if st.last_ts else "-"
        version = "-" if st.version is None else str(st.version)
        shown = "exited" if alive is False and st.state != "failed" else st.state
        table.add_row(name, mark, shown, version, flight, ago, st.last_event)
    return table


def progress(state: RunState) -> Text:
    """The step, pace, ETA and the run's wall time (`runtime.views.wall_clock`, as the launcher's
    end summary and `tandem report` show it)."""
    wall = wall_label(state.wall_s())
    if not state.steps:
        return Text(f"waiting for the first step ...   {wall}")
    last = state.steps[-1]
    eta = state.eta_s()
    rate = state.step_rate()
    return Text(
        f"step {last['step']}/{state.total_steps or '?'}   {rate * 60:.1f} steps/min   "
        f"eta {clock(eta) if eta is not None else '?'}   {wall}"
    )


def last_metrics(state: RunState) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    if state.steps:
        m = state.steps[-1]

        def v(key: str) -> float:
            return metric(m, key)

        rows = [
            ("reward", f"{v('reward_mean'):.3f}  (std {v('reward_std'):.3f})"),
            ("length", f"{v('response_len_mean'):.1f} tokens per response (mean)"),
            ("staleness", f"mean {v('staleness_mean'):.2f}  max {v('staleness_max')}"),
            ("throughput", f"{v('samples_per_s'):.1f} samples/s  {v('tokens_per_s'):.0f} tokens/s"),
            ("idle", f"rollouts {v('rollout_idle_ratio'):.0%}  trainer {v('trainer_idle_ratio'):.0%}"),
            ("weight sync", f"{v('weight_sync_s'):.3f}s"),
            ("dropped", f"stale {v('dropped_stale_total')}  filtered {v('dropped_filtered_total')}"),
        ]
        if state.validation:
            val = state.validation[-1]
            rows.append(("validation", f"step {val['step']}: reward {metric(val, 'val/reward_mean'):.3f}"))
        for key, text in rows:
            table.add_row(key, text)
    rewards = [float(metric(m, "reward_mean")) for m in state.steps]
    rates = [float(metric(m, "samples_per_s")) for m in state.steps]
    table.add_row("reward ~", Text(sparkline(rewards), style="cyan"))
    table.add_row("samples/s ~", Text(sparkline(rates), style="magenta"))
    return table


def frame(state: RunState, *, live: bool = True) -> Group:
    """One view of the run; `live`: the header says how to quit (not in a `--once` frame)."""
    now = time.time()
    head = Text(f"tandem watch {state.run_dir}" + ("   (q or Ctrl-C quits)" if live else ""), style="bold")
    if state.num_skipped():
        head.append("\n" + skipped_warning(state.num_skipped(), "metrics.jsonl / schedule.jsonl"), style="yellow")
    return Group(head, roles_table(state, now), Panel(Group(progress(state), last_metrics(state)), title="training"))


def run_watch(args: argparse.Namespace) -> int:
    state = RunState(args.run_dir)
    if not state.run_dir.is_dir():
        print(f"tandem: error: {state.run_dir} is not a directory", file=sys.stderr)
        return 2
    console = Console()
    state.poll()
    if args.once or not console.is_terminal:
        console.print(frame(state, live=False))
        if not args.once:  # a live view redrawn into a file or a pipe would be no view at all
            print(
                "tandem: watch: the output is not a terminal, so this is one frame (--once); "
                "run it in a terminal for the live view",
                file=sys.stderr,
            )
        return 0
    try:
        with _keys() as pressed, Live(frame(state), console=console, screen=False, auto_refresh=False) as live:
            while "q" not in pressed(args.interval):
                state.poll()
                live.update(frame(state), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """`pressed(timeout_s)`: the keys typed within `timeout_s` (sleeps when stdin is no terminal)."""
    if not sys.stdin.isatty():

        def wait(timeout_s: float) -> str:
            time.sleep(timeout_s)
            return ""

        yield wait
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def pressed(timeout_s: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return os.read(fd, 64).decode(errors="replace").lower() if ready else ""

    try:
        yield pressed
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _role_order(name: str) -> tuple[int, str]:
    order = ("launcher", "controller", "rollout", "trainer", "critic", "reward")
    kind = name.rsplit("-", 1)[0]
    return (order.index(kind) if kind in order else len(order), name)


def add_watch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
