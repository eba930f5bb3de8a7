"""`tandem watch`'s state and frame: roles from their logs (alive by pid), steps from
metrics.jsonl read incrementally (a half-written line waits), groups in flight from the
schedule, the ETA from the pace of the steps, and the frame a terminal gets."""

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

from runtime.views.watch import frame, sparkline
from runtime.views.watch_state import RunState
from tests.conftest import ROOT

RECORDED = ROOT / "tests" / "data" / "tiny_run"


def log_line(role: str, rank: int, pid: int, event: str, **fields: object) -> str:
    rec = {"ts": time.time(), "level": "info", "role": role, "rank": rank, "pid": pid, "event": event, **fields}
    return json.dumps(rec) + "\n"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def live_run(tmp_path: Path, metrics_lines: int) -> Path:
    """A run directory as a running run leaves it: the recorded run's first steps, and logs
    of a live controller (this process) and a rollout that is gone."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    shutil.copy(RECORDED / "config.yaml", run)
    lines = (RECORDED / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:metrics_lines]))
    (run / "logs" / "controller-0.jsonl").write_text(
        log_line("controller", 0, os.getpid(), "ready", version=0) + log_line("controller", 0, os.getpid(), "step",
                                                                                version=3)
    )  # fmt: skip
    (run / "logs" / "rollout-0.jsonl").write_text(log_line("rollout", 0, dead_pid(), "ready", version=2))
    return run


def test_roles_steps_and_in_flight_groups_are_read_as_they_are_appended(tmp_path: Path) -> None:
    run = live_run(tmp_path, metrics_lines=4)  # validation at step 0, then steps 1..3
    schedule = [
        {"ev": "dispatch", "g": 1, "to": "rollout-0", "try": 1, "t": 1.0},
        {"ev": "dispatch", "g": 2, "to": "rollout-0", "try": 1, "t": 1.0},
        {"ev": "sampled", "g": 1, "to": "rollout-0", "t0": 1.0, "vmin": 0, "vmax": 0, "tok": 4, "t": 2.0},
    ]
    (run / "schedule.jsonl").write_text("".join(json.dumps(r) + "\n" for r in schedule))
    state = RunState(run)
    state.poll()
    assert [s["step"] for s in state.steps] == [1, 2, 3] and [v["step"] for v in state.validation] == [0]
    ctl, rollout = state.roles["controller-0"], state.roles["rollout-0"]
    assert (ctl.alive(), ctl.state, ctl.version) == (True, "ready", 3)
    assert (rollout.alive(), rollout.version) == (False, 2)
    assert state.in_flight_of("rollout-0") == 1
    nxt = (RECORDED / "metrics.jsonl").read_text().splitlines(keepends=True)[4]
    with open(run / "metrics.jsonl", "a") as f:
        f.write(nxt[:20])  # half a line: not read yet
    state.poll()
    assert len(state.steps) == 3
    with open(run / "metrics.jsonl", "a") as f:
        f.write(nxt[20:])
    state.poll()
    assert [s["step"] for s in state.steps] == [1, 2, 3, 4]
    pace = (state.steps[-1]["wall_s"] - state.steps[0]["wall_s"]) / 3
    assert abs(state.eta_s() - 36 * pace) < 1e-6  # 40 steps in the config


def test_the_frame_shows_the_role_table_progress_and_sparklines(tmp_path: Path) -> None:
    state = RunState(live_run(tmp_path, metrics_lines=100))
    state.poll()
    buf = io.StringIO()
    Console(file=buf, width=140, force_terminal=False).print(frame(state))
    text = buf.getvalue()
    for expected in ("controller-0", "rollout-0", "alive", "flight", "step 40/40", "eta 0s", "reward ~",
                     "validation   step 40"):  # fmt: skip
        assert expected in text, expected
    row = next(line for line in text.splitlines() if "rollout-0" in line)
    assert " no " in row and "exited" in row and " ? " in row, "no schedule.jsonl: groups in flight unknown"


def test_sparkline_scales_between_min_and_max() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([5.0, 5.0]) == "▁▁" and sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=40)) == 40


def test_type_corrupted_lines_are_skipped_and_counted_once(tmp_path: Path) -> None:
    run = live_run(tmp_path, metrics_lines=6)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "reward_mean": "high", "wall_s": 9.0}) + "\n")
        f.write('{"step": 7, "rew\n')
    (run / "schedule.jsonl").write_text(json.dumps({"ev": "dispatch", "g": "one", "to": "rollout-0", "t": 1}) + "\n")
    state = RunState(run)
    state.poll()
    assert [s["step"] for s in state.steps] == [1, 2, 3, 4, 5] and state.num_skipped() == 3
    buf = io.StringIO()
    Console(file=buf, width=140, force_terminal=False).print(frame(state))
    assert buf.getvalue().count("skipped 3 line(s)") == 1
    done = subprocess.run([sys.executable, "-m", "runtime.cli", "watch", "--once", str(run)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_at_80_columns_role_names_and_events_are_whole(tmp_path: Path) -> None:
    """At 80 columns the table cut names to `controlle…` and `engine_ar…`."""
    run = live_run(tmp_path, metrics_lines=4)
    with open(run / "logs" / "rollout-0.jsonl", "a") as f:
        f.write(log_line("rollout", 0, dead_pid(), "engine_args", version=2))
    (run / "logs" / "launcher-0.jsonl").write_text(log_line("launcher", 0, os.getpid(), "spawned"))
    (run / "logs" / "controller-0.jsonl").write_text(log_line("controller", 0, os.getpid(), "weights_applied"))
    state = RunState(run)
    state.poll()
    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=False).print(frame(state))
    text = buf.getvalue()
    assert "…" not in text, text
    assert max(map(len, text.splitlines())) <= 80
    for whole in ("launcher-0", "controller-0", "rollout-0", "engine_args", "weights_applied"):
        assert whole in text, (whole, text)
