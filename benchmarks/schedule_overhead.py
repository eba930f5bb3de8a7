"""What the schedule log (RUN_DIR/schedule.jsonl, roles/controller/schedule.py) costs a run.
Prints one JSON object.

    .venv/bin/python benchmarks/schedule_overhead.py [--config configs/tiny_cpu.yaml] [--pairs 3]

Runs the config `--pairs` times with `metrics.schedule=true` and as often with `false`,
alternating (true, false, true, ...), each a separate `tandem launch --quiet`, and reports
each wall time, the medians and `overhead` = median(true) / median(false) - 1. On a noisy
machine the wall times spread more than the log can cost, so it also times the writer
alone: `writer_us_per_record` (the same record mix, written to a file here) and
`records_per_run` (lines of the runs' schedule.jsonl), whose product is the log's own
cost per run (`writer_s_per_run`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.json_out import ROOT, provenance


def launch(config: str, run_dir: Path, schedule: bool, overrides: list[str]) -> float:
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "--quiet", config, f"run_dir={run_dir}"]
    cmd += [f"metrics.schedule={'true' if schedule else 'false'}", *overrides]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run {run_dir.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - started


def writer_cost(records: int = 20000) -> float:
    """Seconds per record of ScheduleLog writing a tiny run's record mix."""
    from roles.controller.schedule import ScheduleLog

    with tempfile.TemporaryDirectory() as d:
        log = ScheduleLog(Path(d) / "schedule.jsonl")
        started = time.perf_counter()
        for i in range(records // 5):
            log.admit(i, 3, i)
            log.dispatch(i, "rollout-0", 0)
            log.sampled(i, "rollout-0", time.time(), 2, 3, 400)
            log.scored(i)
            log.step(i, 3, time.time(), [i], {"train_s": 0.5})
        log.close()
        return (time.perf_counter() - started) / records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny_cpu.yaml")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--run-root", default="", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    root = Path(args.run_root or tempfile.mkdtemp(prefix="tandem-schedule-overhead-"))
    walls: dict[str, list[float]] = {"true": [], "false": []}
    records: list[int] = []
    for i in range(args.pairs):
        for schedule in (True, False):
            run_dir = root / f"{'with' if schedule else 'without'}-{i}"
            walls[str(schedule).lower()].append(round(launch(args.config, run_dir, schedule, args.overrides), 2))
            if schedule:
                records.append(sum(1 for _ in (run_dir / "schedule.jsonl").open()))
    with_s, without_s = statistics.median(walls["true"]), statistics.median(walls["false"])
    per_record = writer_cost()
    result = {
        "benchmark": "schedule_overhead",
        "config": args.config,
        **provenance(),
        "wall_s_with": walls["true"],
        "wall_s_without": walls["false"],
        "median_with_s": with_s,
        "median_without_s": without_s,
        "overhead": round(with_s / without_s - 1, 4),
        "records_per_run": statistics.median(records),
        "writer_us_per_record": round(per_record * 1e6, 2),
        "writer_s_per_run": round(per_record * statistics.median(records), 4),
    }
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
