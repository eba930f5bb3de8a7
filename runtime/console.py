"""The launcher's console view: role readiness, warnings and errors, and a progress line.

On a terminal the training progress is one live rich progress bar with the step's key
metrics; otherwise (CI, pipes) each step is printed as a plain line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console as RichConsole
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runtime.config import RunConfig

SHOWN_INFO = {"ready", "run_finished", "checkpoint_saved", "resumed", "worker_joined", "worker_lost"}


class Console:
    def __init__(self, run_dir: Path, cfg: RunConfig) -> None:
        self.out = RichConsole(highlight=False, soft_wrap=True)
        self.total = cfg.trainer.total_steps
        self.progress: Progress | None = None
        self.task: Any = None

    def note(self, text: str) -> None:
        self.out.print(f"[bold]tandem[/]: {escape(text)}")

    def error(self, text: str) -> None:
        self.out.print(f"[bold red]tandem: {escape(text)}[/]")

    def show(self, rec: dict[str, Any]) -> None:
        level, event = rec.get("level", "info"), rec.get("event", "")
        who = f"{rec.get('role', '?')}-{rec.get('rank', 0)}"
        if event == "step" and rec.get("role") == "controller":
            self._step(rec)
        elif level in ("warning", "error", "critical"):
            colour = "yellow" if level == "warning" else "red"
            self.out.print(f"[{colour}]{escape(who)} {level} {escape(event)}[/] {escape(_fields(rec))}")
        elif event in SHOWN_INFO:
            self.out.print(f"[green]{escape(who)}[/] {escape(event)} {escape(_fields(rec))}")

    def _step(self, rec: dict[str, Any]) -> None:
        step = int(rec.get("step", 0))
        line = (
            f"v{rec.get('policy_version', '?')} reward {rec.get('reward_mean', 0):.3f} "
            f"stale≤{rec.get('staleness_max', 0)} drop {rec.get('dropped_stale', 0)} "
            f"{rec.get('samples_per_s', 0):.1f} samples/s idle gen {rec.get('rollout_idle_ratio', 0):.0%} "
            f"train {rec.get('trainer_idle_ratio', 0):.0%}"
        )
        if not self.out.is_terminal:
            self.out.print(f"step {step}/{self.total} {line}")
            return
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[line]}"), console=self.out, transient=False,
            )  # fmt: skip
            self.task = self.progress.add_task("train", total=self.total, line="")
            self.progress.start()
        self.progress.update(self.task, completed=step, line=line)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _fields(rec: dict[str, Any]) -> str:
    skip = {"ts", "time", "level", "role", "rank", "pid", "event"}
    parts = [f"{k}={_short(v)}" for k, v in rec.items() if k not in skip]
    return " ".join(parts)


def _short(v: Any) -> str:
    text = str(v)
    return text if len(text) <= 200 else text[:197] + "..."
