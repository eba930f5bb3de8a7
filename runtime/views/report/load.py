"""Reading a run directory for the report: tolerant of a run that crashed or is still
writing, or a file that is damaged: a line that is not JSON (half-written, truncated,
binary) or not a valid record (runtime/views/records.py: a field of the wrong type) is skipped
and counted in `RunData.skipped`.

What a caller may rely on:
* `RunData.steps`: the step records of metrics.jsonl in file order (no `kind`), the last one
  kept when a resumed run wrote a step twice; `RunData.validation`: its `kind: validation`
  records.
* `RunData.schedule`: schedule.1.jsonl (the rotated part, if any) then schedule.jsonl;
  empty when the run wrote none. A resumed run rolled back to its checkpoint: the records of
  what it then did again (steps after the checkpoint's, groups from its next group id on)
  are left out (`current_schedule`), so every trained group is in one `step` record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.identity.paths import METRICS, SCHEDULE, SCHEDULE_ROTATED
from runtime.views.records import metric, usable_metrics, usable_schedule


@dataclass
class RunData:
    name: str
    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    schedule: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # file name -> lines left out

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the step records that have `key`; a NaN or infinite value
        (however it was written: runtime/views/records.py) is a float, which plotly draws as a gap."""
        rows = [(int(r["step"]), float(metric(r, key))) for r in self.steps if key in r]
        return [s for s, _ in rows], [v for _, v in rows]

    def has(self, key: str) -> bool:
        return any(key in r for r in self.steps)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of `path` (none when it is missing); lines that do not parse are skipped."""
    return read_records(path, lambda rec: isinstance(rec, dict))[0]


def read_records(path: Path, usable: Callable[[Any], bool]) -> tuple[list[dict[str, Any]], int]:
    """The records of `path` that pass `usable`, and how many non-empty lines did not."""
    if not path.exists():
        return [], 0
    out, num_skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if usable(rec):
            out.append(rec)
        elif line.strip():
            num_skipped += 1
    return out, num_skipped


def load_run(run_dir: str | Path) -> RunData:
    """A run's metrics and schedule; raises FileNotFoundError when `run_dir` has neither, or
    is not a directory."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    skipped: dict[str, int] = {}
    parts = {}
    for name, usable in ((METRICS, usable_metrics), (SCHEDULE_ROTATED, usable_schedule), (SCHEDULE, usable_schedule)):
        parts[name], num_skipped = read_records(root / name, usable)
        if num_skipped:
            skipped[name] = num_skipped
    metrics = parts[METRICS]
    schedule = current_schedule(parts[SCHEDULE_ROTATED] + parts[SCHEDULE])
    if not metrics and not schedule and not (root / METRICS).exists():
        raise FileNotFoundError(f"{root} has no metrics.jsonl or schedule.jsonl (is it a run directory?)")
    by_step: dict[int, dict[str, Any]] = {}
    for rec in metrics:
        if "kind" not in rec and _number(rec.get("step")):
            by_step[int(rec["step"])] = rec
    validation = [r for r in metrics if r.get("kind") == "validation"]
    return RunData(
        name=root.resolve().name,
        run_dir=root,
        steps=[by_step[s] for s in sorted(by_step)],
        validation=validation,
        schedule=schedule,
        skipped=skipped,
    )


def current_schedule(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that still count after every restart: a `run` record with `step` S and
    `next_g` G (a resume from step S's checkpoint) drops the earlier records of steps after S
    and of training groups G and later, whose work the resumed run does again."""
    out: list[dict[str, Any]] = []
    for rec in records:
        if rec.get("ev") == "run" and out and "next_g" in rec:
            step, next_g = int(rec.get("step", 0)), int(rec["next_g"])
            out = [r for r in out if not _rolled_back(r, step, next_g)]
        out.append(rec)
    return out


def _rolled_back(rec: dict[str, Any], step: int, next_g: int) -> bool:
    if rec.get("ev") == "step":
        return int(rec.get("step", 0)) > step
    g = rec.get("g")
    return isinstance(g, int) and g >= next_g


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
