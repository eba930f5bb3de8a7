"""The launcher's end-of-run summary: the last step's key metrics (NaN / inf shown as such),
where the run and its model are, and the commands that read them, with the program named as
the user ran it (`.venv/bin/tandem report ...` after `.venv/bin/tandem launch ...`), so they
run as printed from the same shell."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from runtime.checkpoints import checkpoint
from runtime.identity.paths import METRICS
from runtime.views.records import metric

SHOWN = ("reward_mean", "response_len_mean", "staleness_mean")


def last_step(run_dir: Path) -> dict[str, object]:
    """The last training record of `RUN_DIR/metrics.jsonl` ({} when there is none)."""
    path = run_dir / METRICS
    if not path.is_file():
        return {}
    for line in reversed(path.read_text(errors="replace").splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "kind" not in rec and "step" in rec:
            return rec
    return {}


def model_path(run_dir: Path) -> Path | None:
    """The policy of the newest intact checkpoint: its `hf/` or `adapter/` folder, else
    the checkpoint folder (export consolidates its shards); None without a checkpoint."""
    found = checkpoint.find_latest(run_dir, quiet=True)
    if found is None:
        return None
    path = found[0]
    return next((path / part for part in ("hf", "adapter") if (path / part).is_dir()), path)


def end_summary(run_dir: Path, wall: str) -> list[str]:
    """The summary's lines; `wall`: the run's wall time as `runtime.views.wall_clock.wall_label`
    writes it (`wall 5m27s`), the figure `tandem watch` and `tandem report` show too."""
    rec = last_step(run_dir)
    head = f"finished: {wall}"
    if rec:
        shown = [f"{k} {metric(rec, k):.3f}" for k in SHOWN if k in rec]
        head += f", step {rec['step']}" + "".join(f", {s}" for s in shown)
    lines = [head, f"  run directory  {run_dir}"]
    model = model_path(run_dir)
    lines.append(f"  model          {model}" if model else "  model          none (checkpoint.final=false)")
    lines.append(f"  report         {program()} report {run_dir}")
    if model:
        merge = " [--merge]" if model.name == "adapter" else ""
        lines.append(f"  export         {program()} export {run_dir} OUT_DIR{merge}")
    return lines


def program() -> str:
    """`tandem` as the user can run it again: the path this process was started by
    (`.venv/bin/tandem`) unless `tandem` on PATH is that program (an activated venv); plain
    `tandem` when it was started otherwise (`python -m runtime.cli`, a test)."""
    started = Path(sys.argv[0])
    on_path = shutil.which("tandem")
    if started.name != "tandem" or (on_path and Path(on_path).resolve() == started.resolve()):
        return "tandem"
    return sys.argv[0]
