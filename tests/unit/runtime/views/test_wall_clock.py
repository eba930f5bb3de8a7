"""One wall clock: the launcher's end summary, `tandem watch` and `tandem report` show the
same labelled figure (`wall 5m27s`) for a recorded run (tests/data/tiny_run), read from
RUN_DIR/wall.json; a resumed run adds the launches before it; a run whose launcher died
stops at its last write."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from runtime.config.load import load_config
from runtime.views.console import Console as LaunchConsole
from runtime.views.report.build import build_report, summary
from runtime.views.report.load import load_run
from runtime.views.summary import end_summary
from runtime.views.wall_clock import WALL_FILE, record_end, record_start, run_wall_s, wall_label
from runtime.views.watch import frame
from runtime.views.watch_state import RunState
from tests.conftest import ROOT

RECORDED = ROOT / "tests" / "data" / "tiny_run"


def recorded_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    return run


def last_steps_wall(run: Path) -> float:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return float([r for r in steps if "kind" not in r][-1]["wall_s"])


def watch_text(run: Path) -> str:
    state = RunState(run)
    state.poll()
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(frame(state))
    return console.export_text()


def test_summary_watch_and_report_show_the_same_wall_time(tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    record_start(run, 1_000_000.0, continued=False)
    assert record_end(run, 1_000_327.0) == 327.0
    assert run_wall_s(run) == 327.0

    assert end_summary(run, wall_label(run_wall_s(run)))[0].startswith("finished: wall 5m27s, step 40,")
    assert "wall 5m27s" in watch_text(run)
    assert summary(load_run(run))["wall"] == "wall 5m27s"
    assert "wall 5m27s" in build_report(run, tmp_path / "r.html").read_text()
    launcher = LaunchConsole(run, load_config("configs/tiny_cpu.yaml", []))  # the progress line
    buf = io.StringIO()
    launcher.out = Console(file=buf, highlight=False, soft_wrap=True, width=300)
    launcher.show({"role": "controller", "rank": 0, "event": "step", "step": 40, "wall_s": last_steps_wall(run)})
    assert "wall 5m27s" in buf.getvalue() and "0:00" not in buf.getvalue()
    # The steps' own clock is labelled apart, not as "wall".
    steps_wall = last_steps_wall(run)
    assert summary(load_run(run))["training time"].startswith("training ") and steps_wall != 327.0


def test_a_live_run_counts_to_now_and_a_dead_one_stops_at_its_last_write(tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    record_start(run, time.time() - 65, continued=False)  # this process is the "launcher": alive
    assert 64 < (run_wall_s(run) or 0) < 70
    assert "wall 1m0" in watch_text(run)

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rec = json.loads((run / WALL_FILE).read_text())
    last = time.time() - 20
    os.utime(run / "metrics.jsonl", (last, last))
    os.utime(run / "schedule.jsonl", (last, last))
    (run / WALL_FILE).write_text(json.dumps({**rec, "pid": int(dead.stdout)}))
    assert abs((run_wall_s(run) or 0) - 45) < 2


def test_a_resumed_run_adds_the_earlier_launches(tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    record_start(run, 1000.0, continued=False)
    record_end(run, 1100.0)
    record_start(run, 5000.0, continued=True)
    assert record_end(run, 5030.0) == 130.0
    record_start(run, 9000.0, continued=False)  # resume=fresh, or a new run: the clock starts over
    assert record_end(run, 9010.0) == 10.0


def test_a_run_dir_without_wall_json_shows_its_last_steps_clock(tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    steps_wall = last_steps_wall(run)
    assert run_wall_s(run) == steps_wall
    assert wall_label(run_wall_s(run)) in watch_text(run)
    assert wall_label(None) == "wall ?" and wall_label(3723) == "wall 1h02m03s"
