"""A run directory belongs to one run.

* While a launcher runs, it holds an exclusive `flock` on `RUN_DIR/launch.lock` (the file
  records its pid): a second launch into the directory is refused in one line naming that
  pid. The kernel drops the lock when the process ends, however it ends, so a crashed
  run leaves no stale lock; a launcher that returns removes the file
  (`release_run_dirs(remove=True)`).
* A directory that holds an earlier run (`metrics.jsonl` with a line, a checkpoint, or
  node 0's launcher log of a launch that crashed before its first step) is launched
  into only with `resume=auto` (continue it from its last checkpoint; with none, start
  over as `resume=fresh` does) or `resume=fresh` (start over: the earlier run's files are
  moved, and the move is printed, to `RUN_DIR/earlier/<UTC time>/`). So a file such as
  metrics.jsonl or logs/launcher-0.jsonl always holds one run's lines.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import IO

from runtime.config import RunConfig
from runtime.errors import ConfigError
from runtime.identity.paths import CHECKPOINTS, METRICS

LOCK_FILE = "launch.lock"
EARLIER = "earlier"
# What a run writes that belongs to that run alone (the model made under the run dir,
# keys and the run token stay: they are inputs, not results).
RUN_OUTPUTS = (
    METRICS,
    CHECKPOINTS,
    "logs",
    "tb",
    "report.html",
    "report.png",
    "config.yaml",
    "wall.json",
)
_held: list[IO[str]] = []  # the open lock files: a lock lives as long as its open file


def lock_run_dir(run_dir: Path) -> None:
    """Hold `run_dir`'s lock for the rest of this process; a ConfigError naming the holder's
    pid when another process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 (held until the process exits)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ConfigError(
            f"run directory {run_dir} is in use by a running launch (pid {holder}); "
            "wait for it or stop it, or choose another run_dir=..."
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held.append(f)


def release_run_dirs(*, remove: bool = False) -> None:
    """Drop every lock this process holds (tests launch several runs in one process);
    `remove`: delete the lock files too (a finished launch leaves none behind). A file is
    unlinked while still locked, so no other launcher can take a lock on it meanwhile."""
    while _held:
        f = _held.pop()
        if remove:
            Path(f.name).unlink(missing_ok=True)
        f.close()


def earlier_run(run_dir: Path) -> list[str]:
    """What of an earlier run `run_dir` holds: metrics.jsonl with a line, checkpoints, and
    node 0's launcher log, which a launch writes before its first step. Not config.yaml or
    other nodes' logs: in a multi-node run the other nodes' launchers write those into the
    shared directory while node 0 is still checking it."""
    found = []
    metrics = run_dir / METRICS
    if metrics.is_file() and metrics.stat().st_size:
        found.append(METRICS)
    ckpts = run_dir / CHECKPOINTS
    if ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir()):
        found.append("checkpoints/")
    first_log = run_dir / "logs" / "launcher-0.jsonl"
    if first_log.is_file() and first_log.stat().st_size:
        found.append("logs/launcher-0.jsonl")
    return found


def check_run_dir(cfg: RunConfig) -> list[str]:
    """Refuse (ConfigError) a run directory holding an earlier run unless `resume` says what
    to do with it; with `resume=fresh`, move the earlier run aside and return what moved."""
    run_dir = Path(cfg.run_dir)
    found = earlier_run(run_dir)
    if not found or cfg.resume == "auto":
        return []
    if cfg.resume == "fresh":
        return set_aside(run_dir)
    raise ConfigError(
        f"run directory {run_dir} holds an earlier run ({', '.join(found)}): continue it with resume=auto, "
        f"start over there with resume=fresh (moves it to {run_dir / EARLIER}/), or choose a new run_dir=..."
    )


def set_aside(run_dir: Path) -> list[str]:
    """Move the earlier run's outputs into `RUN_DIR/earlier/<UTC time>/`; returns
    "src -> dst" for each path moved."""
    dest = run_dir / EARLIER / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for name in RUN_OUTPUTS:
        src = run_dir / name
        if src.exists():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.move(src, dest / name)
            moved.append(f"{src} -> {dest / name}")
    for src in sorted(run_dir.glob("schedule*.jsonl")):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dest / src.name)
        moved.append(f"{src} -> {dest / src.name}")
    return moved
