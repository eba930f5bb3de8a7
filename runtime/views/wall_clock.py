"""The run's one wall clock: what `tandem launch` (progress line and end summary),
`tandem watch` and `tandem report` show as `wall 5m27s`.

Definition: seconds since the launcher started the run, until it ended. The launcher
records both instants (Unix time) in `RUN_DIR/wall.json`; a run resumed from a checkpoint
adds the wall time of the launches before it (`before_s`), as the steps' `wall_s` does.
What a caller may rely on:

* `run_wall_s(run_dir)` is the same number for every reader of a finished run; while the
  launcher lives it grows with the time of day; for a run whose launcher died without
  recording the end, it stops at the run directory's last write (metrics, schedule, logs).
* A run directory written before this file existed has no `wall.json`: its wall time is the
  last step's `wall_s` (the controller's clock, which starts when every role is ready).
* `launcher_done(run_dir)`: the run's launcher has ended (what `tandem tail -f` stops at).
* `wall_label(seconds)` is the one format: `wall 5m27s` (`wall ?` when unknown or not finite).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from runtime.identity.paths import METRICS
from runtime.views.summary import last_step

WALL_FILE = "wall.json"


def clock(seconds: float) -> str:
    """`1h02m03s`, `2m05s` or `7s`; `?` for NaN or infinity (a damaged metrics line)."""
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m{s % 60:02d}s" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


def wall_label(seconds: float | None) -> str:
    """The label and format every view uses for the run's wall time."""
    return "wall ?" if seconds is None else f"wall {clock(seconds)}"


def record_start(run_dir: Path, started_at: float, *, continued: bool) -> None:
    """The launcher started (Unix time `started_at`); `continued`: this launch resumes the
    run recorded there, so its wall time so far is carried over."""
    before = run_wall_s(run_dir) if continued else None
    _write(run_dir, {"started_at": started_at, "before_s": before or 0.0, "pid": os.getpid()})


def record_end(run_dir: Path, ended_at: float | None = None) -> float:
    """The launcher is done; returns the run's wall time. Only the launcher that recorded
    the start records the end (a `--join` launcher sharing the directory reads it)."""
    rec = _read(run_dir)
    if rec is None or rec.get("pid") != os.getpid():
        return run_wall_s(run_dir) or 0.0
    rec["ended_at"] = time.time() if ended_at is None else ended_at
    _write(run_dir, rec)
    return float(rec["before_s"]) + rec["ended_at"] - float(rec["started_at"])


def run_wall_s(run_dir: Path, now: float | None = None) -> float | None:
    """The run's wall time in seconds (see the module docstring); None when nothing says."""
    rec = _read(run_dir)
    if rec is None:
        return _last_step_wall(run_dir)
    end = rec.get("ended_at")
    if end is None:
        end = (time.time() if now is None else now) if _alive(int(rec.get("pid", 0))) else _last_write(run_dir)
    return float(rec.get("before_s", 0.0)) + max(0.0, float(end) - float(rec["started_at"]))


def launcher_done(run_dir: Path, grace_s: float = 5.0) -> bool:
    """Whether the launcher recorded in `run_dir` has ended: its process is gone, or it
    recorded the run's end `grace_s` ago (time for its last log lines). False when no
    launcher was recorded (nothing ran here yet, or a directory older than wall.json)."""
    rec = _read(run_dir)
    if rec is None:
        return False
    end = rec.get("ended_at")
    return not _alive(int(rec.get("pid", 0))) or (isinstance(end, int | float) and time.time() - end >= grace_s)


def _read(run_dir: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads((run_dir / WALL_FILE).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("started_at"), int | float) else None


def _write(run_dir: Path, rec: dict[str, Any]) -> None:
    tmp = run_dir / (WALL_FILE + ".tmp")
    tmp.write_text(json.dumps(rec) + "\n")
    tmp.replace(run_dir / WALL_FILE)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _last_write(run_dir: Path) -> float:
    paths = [run_dir / METRICS, *run_dir.glob("schedule*.jsonl"), *run_dir.glob("logs/*.jsonl")]
    return max((p.stat().st_mtime for p in paths if p.is_file()), default=(run_dir / WALL_FILE).stat().st_mtime)


def _last_step_wall(run_dir: Path) -> float | None:
    wall = last_step(run_dir).get("wall_s")
    return float(wall) if isinstance(wall, int | float) else None
