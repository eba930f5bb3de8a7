"""The CLI's edges: every subcommand's error is one line `tandem: error: ...` (exit 2; a stale
reference exit 1), a missing run directory is "not a directory" for each of them,
`tandem tail --role` naming no log says which logs there are, `tandem tail -f` stops when
the run's launcher has ended, and `tandem launch --help` says how run_dir= and resume= work."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.cli import build_parser
from runtime.views.tail import run_tail
from tests.conftest import ROOT
from tests.unit.runtime.views.test_tail import parse, record, write


def tandem(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "runtime.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", ["tail", "watch", "report", "export"])
def test_a_missing_run_directory_is_one_error_line_naming_it(tmp_path: Path, command: str) -> None:
    missing = str(tmp_path / "no_such_run")
    args = [command, missing] + (["out"] if command == "export" else [])
    done = tandem(*args)
    assert done.returncode == 2
    assert done.stderr == f"tandem: error: {missing} is not a directory\n"


def test_launch_and_config_docs_errors_have_the_same_prefix(tmp_path: Path) -> None:
    done = tandem("launch", str(tmp_path / "nope.yaml"))
    assert done.returncode == 2 and done.stderr.startswith("tandem: error: ") and done.stderr.count("\n") == 1
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    done = tandem("config-docs", "--check", str(stale))
    assert done.returncode == 1 and done.stderr.startswith("tandem: error: ") and done.stderr.count("\n") == 1


def a_run(tmp_path: Path, *, launcher_pid: int, ended: bool) -> Path:
    """A run directory with three roles' logs, as its launcher (`launcher_pid`) leaves it."""
    now = time.time()
    write(tmp_path, "trainer-0.jsonl", record("trainer", 0, now, "t0"))
    write(tmp_path, "trainer-1.jsonl", record("trainer", 1, now, "t1"))
    write(tmp_path, "rollout-0.jsonl", record("rollout", 0, now, "r0"))
    wall = {"started_at": now - 60, "before_s": 0.0, "pid": launcher_pid} | ({"ended_at": now - 10} if ended else {})
    (tmp_path / "wall.json").write_text(json.dumps(wall))
    return tmp_path


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_role_with_no_log_is_refused_naming_the_logs_there(tmp_path: Path) -> None:
    run = a_run(tmp_path, launcher_pid=dead_pid(), ended=True)
    done = tandem("tail", str(run), "--role", "bogus")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("tandem: error: --role bogus: no such log in ") and done.stderr.count("\n") == 1
    assert "rollout-0, trainer-0, trainer-1" in done.stderr
    assert tandem("tail", str(run), "--role", "trainer", "--role", "rollout-0").returncode == 0
    assert tandem("tail", str(run), "--role", "trainer-7").returncode == 2
    assert run_tail(parse(str(run), "--role", "critic", "-f"), io.StringIO(), threading.Event()) == 0  # may start


@pytest.mark.parametrize("how", ["ended", "killed"])
def test_follow_stops_when_the_runs_launcher_has_ended(tmp_path: Path, how: str) -> None:
    run = a_run(tmp_path, launcher_pid=dead_pid(), ended=how == "ended")
    out = io.StringIO()
    never = threading.Event()
    started = time.monotonic()
    assert run_tail(parse(str(run), "-f", "--poll", "0.05"), out, never) == 0
    assert time.monotonic() - started < 5  # stopped by itself (never set), on its first poll
    assert [line.split()[3] for line in out.getvalue().splitlines()] == ["r0", "t0", "t1"]  # equal ts: by file


def test_follow_goes_on_while_the_launcher_lives(tmp_path: Path) -> None:
    run = a_run(tmp_path, launcher_pid=os.getpid(), ended=False)  # this process: alive
    out, stop = io.StringIO(), threading.Event()
    thread = threading.Thread(target=run_tail, args=(parse(str(run), "-f", "--poll", "0.01"), out, stop))
    thread.start()
    try:
        time.sleep(0.3)
        assert thread.is_alive()
        write(run, "trainer-0.jsonl", record("trainer", 0, time.time(), "later"))
        deadline = time.monotonic() + 5
        while "later" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "later" in out.getvalue()
    finally:
        stop.set()
        thread.join(timeout=5)


def test_launch_help_says_how_run_dir_and_resume_work() -> None:
    launch = build_parser()._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]
    text = launch.format_help()
    assert "run_dir=" in text and "resume=auto" in text and "resume=fresh" in text
    assert max(len(line) for line in text.splitlines()) <= 80
