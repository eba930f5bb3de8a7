"""The launcher's console: any log line is printed as text (rich markup in a field is not markup),
the progress line carries the wall time and an ETA, and --quiet prints errors only."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console as RichConsole

from runtime.config.load import load_config
from runtime.views.console import Console


def test_markup_like_text_in_a_log_line_is_printed_verbatim(tmp_path: Path) -> None:
    console = Console(tmp_path, load_config("configs/tiny_cpu.yaml", []))
    buf = io.StringIO()
    console.out = RichConsole(file=buf, highlight=False, soft_wrap=True, width=300)
    cause = "gloo failed [/opt/gloo/transport/tcp/pair.cc:598] Connection closed by peer [bold]"
    console.show({"level": "error", "event": "fatal", "role": "trainer", "rank": 0, "cause": cause})
    console.error(f"role trainer-0 died; last error: {cause}")
    console.note("[/not markup]")
    out = buf.getvalue()
    assert out.count(cause) == 2 and "[/not markup]" in out


def step_record(step: int, wall_s: float) -> dict:
    return {"level": "info", "event": "step", "role": "controller", "rank": 0, "step": step, "wall_s": wall_s}


def test_the_progress_line_has_the_wall_time_and_an_eta_from_the_pace_of_the_steps(tmp_path: Path) -> None:
    console = Console(tmp_path, load_config("configs/tiny_cpu.yaml", []))  # 40 steps
    buf = io.StringIO()
    console.out = RichConsole(file=buf, highlight=False, soft_wrap=True, width=300)  # not a terminal: plain lines
    console.started -= 65.0  # the launcher started 65 s ago
    console.show(step_record(10, 30.0))  # resumed at step 9: the pace comes from steps seen here
    console.show(step_record(12, 34.0))  # 2 s per step, 28 steps left
    console.show(step_record(40, 90.0))
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("step 10/40") and lines[0].endswith("eta ?") and "wall 1m05s" in lines[0]
    assert lines[1].endswith("eta 56s") and lines[2].endswith("eta 0s")


def test_quiet_prints_errors_only_and_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    console = Console(tmp_path, load_config("configs/tiny_cpu.yaml", []), quiet=True)
    console.note("run tiny_cpu: 5 processes")
    console.show(step_record(1, 2.0))
    console.show({"level": "info", "event": "ready", "role": "rollout", "rank": 0})
    console.show({"level": "warning", "event": "validation_skipped", "role": "controller", "rank": 0})
    console.show({"level": "error", "event": "fatal", "role": "trainer", "rank": 1, "cause": "gloo timeout"})
    console.error("role trainer-1 died")
    out = capsys.readouterr()
    assert out.out == ""
    assert "gloo timeout" in out.err and "role trainer-1 died" in out.err
    assert "ready" not in out.err and "step" not in out.err and "5 processes" not in out.err
