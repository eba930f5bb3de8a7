"""`tandem watch RUN_DIR`: a live terminal view of a run (rich; plain ANSI, so it works
over ssh): a table of the roles (alive, policy version, groups in flight, last log line),
the step rate and ETA, the last step's metrics, and sparklines of reward and throughput.

It redraws every `--interval` seconds and quits on `q` or Ctrl-C (exit 0), leaving the
terminal as it found it; `--once` prints one frame and exits (for scripts and pipes)."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from runtime.records import skipped_warning
from runtime.wall_clock import clock, wall_label
from runtime.watch_state import RunState

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as block characters scaled between their min and max."""
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(BARS[min(len(BARS) - 1, int((v - lo) / span * len(BARS)))] for v in values)


def roles_table(state: RunState, now: float) -> Table:
    table = Table(title="roles", expand=False, header_style="bold")
    for col in ("role", "alive", "state", "version", "in flight", "last log", "last event"):
        table.add_column(col)
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
    """The step, pace, ETA and the run's wall time (`runtime.wall_clock`, as the launcher's
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
        rows = [
            ("reward", f"{m.get('reward_mean', 0):.3f}  (std {m.get('reward_std', 0):.3f})"),
            ("staleness", f"mean {m.get('staleness_mean', 0):.2f}  max {m.get('staleness_max', 0)}"),
            ("throughput", f"{m.get('samples_per_s', 0):.1f} samples/s  {m.get('tokens_per_s', 0):.0f} tokens/s"),
            ("idle", f"rollouts {m.get('rollout_idle_ratio', 0):.0%}  trainer {m.get('trainer_idle_ratio', 0):.0%}"),
            ("weight sync", f"{m.get('weight_sync_s', 0):.3f}s"),
            ("dropped", f"stale {m.get('dropped_stale_total', 0)}  filtered {m.get('dropped_filtered_total', 0)}"),
        ]
        if state.validation:
            val = state.validation[-1]
            rows.append(("validation", f"step {val['step']}: reward {val.get('val/reward_mean', 0):.3f}"))
        for key, text in rows:
            table.add_row(key, text)
    rewards = [float(m.get("reward_mean", 0)) for m in state.steps]
    rates = [float(m.get("samples_per_s", 0)) for m in state.steps]
    table.add_row("reward ~", Text(sparkline(rewards), style="cyan"))
    table.add_row("samples/s ~", Text(sparkline(rates), style="magenta"))
    return table


def frame(state: RunState) -> Group:
    now = time.time()
    head = Text(f"tandem watch {state.run_dir}   (q or Ctrl-C quits)", style="bold")
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
    if args.once:
        console.print(frame(state))
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
