"""The launcher's console view: role readiness, warnings and errors, and a progress line.

Warnings and errors are shown with their fields; of the info events only those in
`SHOWN_INFO` (`event key=value ...`) and `PHRASES` (start-up progress, as a sentence). Fields
in `HIDDEN_FIELDS` (`gc_frozen`: a number for whoever tunes the collector) stay in the JSON
logs only. On a terminal the training progress is one live rich progress bar with the step's key
metrics; otherwise (CI, pipes) each step is printed as a plain line. Both end with the run's
wall time so far (since the launcher started) and an ETA from the pace of the steps this
launcher has seen. `quiet` (`tandem launch --quiet`, for scripts) prints errors only, to stderr.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console as RichConsole
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from runtime.config import RunConfig
from runtime.wall_clock import clock, run_wall_s, wall_label

SHOWN_INFO = {"ready", "run_finished", "checkpoint_saved", "resumed", "worker_joined", "worker_lost"}
# Info events shown as a phrase rather than `event key=value ...`: start-up progress.
PHRASES: dict[str, Callable[[dict[str, Any]], str]] = {
    "engine_starting": lambda rec: f"starting vLLM engine (model {rec.get('model', '?')})",
    "engine_started": lambda rec: f"engine ready in {rec.get('seconds', '?')} s",
}
HIDDEN_FIELDS = {"ts", "time", "level", "role", "rank", "pid", "event", "gc_frozen"}  # kept in the JSON logs


class Console:
    def __init__(self, run_dir: Path, cfg: RunConfig, *, quiet: bool = False) -> None:
        self.quiet = quiet
        self.run_dir = run_dir
        self.out = RichConsole(highlight=False, soft_wrap=True, stderr=quiet)
        self.total = cfg.trainer.total_steps
        self.progress: Progress | None = None
        self.task: Any = None
        self.started = time.monotonic()
        self.first: tuple[int, float] | None = None  # (step, wall_s) of the first step record seen

    def note(self, text: str) -> None:
        if not self.quiet:
            self.out.print(f"[bold]tandem[/]: {escape(text)}")

    def error(self, text: str) -> None:
        self.out.print(f"[bold red]tandem: {escape(text)}[/]")

    def show(self, rec: dict[str, Any]) -> None:
        level, event = rec.get("level", "info"), rec.get("event", "")
        who = f"{rec.get('role', '?')}-{rec.get('rank', 0)}"
        if self.quiet and level not in ("error", "critical"):
            return
        if event == "step" and rec.get("role") == "controller":
            self._step(rec)
        elif level in ("warning", "error", "critical"):
            colour = "yellow" if level == "warning" else "red"
            self.out.print(f"[{colour}]{escape(who)} {level} {escape(event)}[/] {escape(_fields(rec))}")
        elif event in PHRASES:
            self.out.print(f"[green]{escape(who)}[/] {escape(PHRASES[event](rec))}")
        elif event in SHOWN_INFO:
            self.out.print(f"[green]{escape(who)}[/] {escape(event)} {escape(_fields(rec))}".rstrip())

    def _step(self, rec: dict[str, Any]) -> None:
        step = int(rec.get("step", 0))
        line = (
            f"v{rec.get('policy_version', '?')} reward {rec.get('reward_mean', 0):.3f} "
            f"stale≤{rec.get('staleness_max', 0)} drop {rec.get('dropped_stale', 0)} "
            f"{rec.get('samples_per_s', 0):.1f} samples/s idle gen {rec.get('rollout_idle_ratio', 0):.0%} "
            f"train {rec.get('trainer_idle_ratio', 0):.0%} {self._wall()} "
            f"eta {self._eta(step, float(rec.get('wall_s', 0.0)))}"
        )
        if not self.out.is_terminal:
            self.out.print(f"step {step}/{self.total} {line}")
            return
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[line]}"), console=self.out, transient=False,
            )  # fmt: skip
            self.task = self.progress.add_task("train", total=self.total, line="")
            self.progress.start()
        self.progress.update(self.task, completed=step, line=line)

    def _wall(self) -> str:
        """The run's one wall clock (runtime/wall_clock.py: earlier launches of a resumed run
        included), as `tandem watch`, `tandem report` and the end summary show it."""
        recorded = run_wall_s(self.run_dir)
        return wall_label(recorded if recorded is not None else time.monotonic() - self.started)

    def _eta(self, step: int, wall_s: float) -> str:
        """Time to the last step at the pace of the steps seen so far ("?" until two are in)."""
        if self.first is None or step <= self.first[0]:
            self.first = self.first or (step, wall_s)
            return "?" if step < self.total else clock(0)
        pace = (wall_s - self.first[1]) / (step - self.first[0])
        return clock(max(0, self.total - step) * pace)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _fields(rec: dict[str, Any]) -> str:
    parts = [f"{k}={_short(v)}" for k, v in rec.items() if k not in HIDDEN_FIELDS]
    return " ".join(parts)


def _short(v: Any) -> str:
    text = str(v)
    return text if len(text) <= 200 else text[:197] + "..."
