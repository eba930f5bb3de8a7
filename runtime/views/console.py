"""The launcher's console view: role readiness, warnings and errors, and a progress line.

Warnings and errors are shown with their fields; of the info events only those in
`SHOWN_INFO` (`event key=value ...`) and `PHRASES` (start-up progress, as a sentence). Fields
in `HIDDEN_FIELDS` (`gc_frozen`: a number for whoever tunes the collector) stay in the JSON
logs only. On a terminal the training progress is one live line (runtime/views/progress_line.py: a
bar, the step count, the step's key metrics as many as fit the width, the ETA); otherwise (CI,
pipes) each step is printed as a plain line with every field. Both carry the run's wall time so
far (since the launcher started) and end with an ETA from the pace of the steps this launcher
has seen. `quiet` (`tandem launch --quiet`, for scripts) prints errors only, to stderr.
While a vLLM engine starts, `tick()` prints a line at least every 10 s with the time since
its start (runtime/views/startup.py). Once `stopping` is set (the launcher was interrupted),
no role's `ready` or start-up progress is printed: those would read as the run going on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console as RichConsole
from rich.live import Live
from rich.markup import escape

from runtime.config import RunConfig
from runtime.views.progress_line import ProgressLine, plain_line, step_fields
from runtime.views.records import metric
from runtime.views.startup import EngineStarts
from runtime.views.wall_clock import clock, run_wall_s, wall_label

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
        self.live: Live | None = None
        self.started = time.monotonic()
        self.first: tuple[int, float] | None = None  # (step, wall_s) of the first step record seen
        self.engines = EngineStarts(run_dir / "logs")
        self.stopping = False

    def note(self, text: str) -> None:
        if not self.quiet:
            self.out.print(f"[bold]tandem[/]: {escape(text)}")

    def error(self, text: str) -> None:
        self.out.print(f"[bold red]tandem: {escape(text)}[/]")

    def show(self, rec: dict[str, Any]) -> None:
        level, event = rec.get("level", "info"), rec.get("event", "")
        who = f"{rec.get('role', '?')}-{rec.get('rank', 0)}"
        self.engines.seen(who, event)
        if self.quiet and level not in ("error", "critical"):
            return
        if self.stopping and level == "info" and (event == "ready" or event in PHRASES):
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

    def tick(self) -> None:
        """Start-up progress that is due (called by the launcher's loop)."""
        for who, text in self.engines.due():
            if not self.quiet and not self.stopping:
                self.out.print(f"[green]{escape(who)}[/] {escape(text)}")

    def _step(self, rec: dict[str, Any]) -> None:
        step = int(metric(rec, "step"))
        eta = self._eta(step, metric(rec, "wall_s"))
        fields = step_fields(rec, self._wall())
        if not self.out.is_terminal:
            self.out.print(escape(plain_line(step, self.total, fields, eta)))
            return
        line = ProgressLine(step, self.total, fields, eta)
        if self.live is None:
            self.live = Live(line, console=self.out, auto_refresh=False, transient=False)
            self.live.start()
        self.live.update(line, refresh=True)

    def _wall(self) -> str:
        """The run's one wall clock (runtime/views/wall_clock.py: earlier launches of a resumed run
        included), as `tandem watch`, `tandem report` and the end summary show it."""
        recorded = run_wall_s(self.run_dir)
        return wall_label(recorded if recorded is not None else time.monotonic() - self.started)

    def _eta(self, step: int, wall_s: float) -> str:
        """Time to the last step at the pace of the steps seen so far ("?" until two are in)."""
        if self.first is None or step <= self.first[0]:
            self.first = self.first or (step, wall_s)
            return "?" if step < self.total else clock(0)
        pace = (wall_s - self.first[1]) / (step - self.first[0])
        return clock(max(0, self.total - step) * pace) if math.isfinite(pace) else "?"

    def finish(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def _fields(rec: dict[str, Any]) -> str:
    parts = [f"{k}={_short(v)}" for k, v in rec.items() if k not in HIDDEN_FIELDS]
    return " ".join(parts)


def _short(v: Any) -> str:
    text = str(v)
    return text if len(text) <= 200 else text[:197] + "..."
