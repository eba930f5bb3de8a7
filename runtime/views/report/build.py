"""`tandem report RUN_DIR [-o FILE.html] [--png DIR] [--compare RUN_DIR2]`.

What a caller may rely on: `build_report` writes one self-contained HTML file (see page.py)
for a finished, crashed or still-running run (what is on disk so far), with a timeline per
run and every panel of `panels.PANELS`, the `--compare` run overlaid; with `png_dir` it
also writes `report.png`, a screenshot of the page by headless Chromium."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from runtime.views.records import metric, skipped_warning
from runtime.views.report.browser import screenshot
from runtime.views.report.gantt import timeline_figure
from runtime.views.report.load import RunData, load_run
from runtime.views.report.page import render
from runtime.views.report.panels import metric_panels
from runtime.views.report.timeline import build_timeline, trained_at
from runtime.views.wall_clock import clock, run_wall_s, wall_label


def build_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    compare: str | Path | None = None,
    png_dir: str | Path | None = None,
) -> Path:
    """Write the report of `run_dir` (default `RUN_DIR/report.html`); returns its path."""
    runs = [load_run(run_dir)] + ([load_run(compare)] if compare else [])
    if compare and runs[0].name == runs[1].name:
        runs[1].name += " (2)"
    for run in runs:
        if run.skipped:
            where = ", ".join(f"{run.run_dir / name} ({n})" for name, n in run.skipped.items())
            print(skipped_warning(sum(run.skipped.values()), where), file=sys.stderr)
    timelines = {}
    heights = 0
    for i, run in enumerate(runs):
        fig = timeline_figure(build_timeline(run.schedule), f"Schedule of {run.name}")
        timelines[str(i)] = fig
        heights += int(fig.layout.height or 400)
    panels = metric_panels(runs)
    title = "Tandem report: " + " vs ".join(r.name for r in runs)
    path = Path(out) if out else Path(run_dir) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(title, [summary(r) for r in runs], timelines, panels))
    if png_dir is not None:
        height = heights + math.ceil(len(panels) / 2) * 340 + 250
        screenshot(path, Path(png_dir) / "report.png", width=1400, height=height)
    return path


def summary(run: RunData) -> dict[str, Any]:
    """One row of the summary table: how far the run got and how its groups ended."""
    total = _total_steps(run.run_dir)
    done = run.steps[-1]["step"] if run.steps else 0
    status = "finished" if total and done >= total else "incomplete (still running, or it stopped)"
    wall = run_wall_s(run.run_dir)
    # The steps' own clock (from the moment every role was ready): what busy time is a share of.
    train = float(metric(run.steps[-1], "wall_s")) if run.steps else 0.0
    train = train if math.isfinite(train) else 0.0
    busy = sum(metric(r, "gen_busy_s") + metric(r, "train_busy_s") for r in run.steps)
    drops = [r for r in run.schedule if r.get("ev") == "drop"]
    whys = sorted({d["why"] for d in drops})
    dropped = ", ".join(f"{w}: {sum(1 for d in drops if d['why'] == w)}" for w in whys) or "0"
    return {
        "run": run.name,
        "status": status,
        "steps": f"{done}/{total or '?'}",
        "wall": wall_label(wall),
        "last reward": f"{metric(run.steps[-1], 'reward_mean'):.3f}" if run.steps else "",
        "training time": f"training {clock(train)}" if train else "",
        "(gen + train busy) / training time": f"{busy / train:.2f}" if train else "",
        "groups trained": len(trained_at(run.schedule)),
        "groups dropped": dropped,
        "validation rounds": len(run.validation),
        "step glue (median)": f"{statistics.median(glue):.3f}s" if (glue := run.series("step_glue_s")[1]) else "",
    }


def _total_steps(run_dir: Path) -> int:
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        return int(cfg["trainer"]["total_steps"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return 0
