"""Start-up progress: after `rollout-0 starting vLLM engine` nothing was printed for 94-179 s.
A line comes at least every 10 s while an engine starts, with the elapsed time and vLLM's
last log line; none once it started, and none (nor a `ready`) once the launcher is stopping."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console as RichConsole

from runtime.config.load import load_config
from runtime.views.console import Console
from runtime.views.startup import EVERY_S, EngineStarts


def test_a_line_every_ten_seconds_with_the_elapsed_time_and_what_vllm_does(tmp_path: Path) -> None:
    (tmp_path / "rollout-0.out").write_text(
        "some warning of torch\n"
        "INFO 12-07 05:01:02 [default_loader.py:267] Loading weights took 0.52 seconds\n"
        "(EngineCore pid=77) INFO 12-07 05:01:09 [gpu_worker.py:298] Memory profiling takes 3.1 seconds\n"
        "a stray line of no vLLM logger\n"
    )
    starts = EngineStarts(tmp_path)
    assert EVERY_S <= 15  # the bound between two lines
    starts.seen("rollout-0", "engine_starting", now=100.0)
    assert starts.due(now=105.0) == []
    assert starts.due(now=110.0) == [
        ("rollout-0", "still starting vLLM engine: 10 s (Memory profiling takes 3.1 seconds)")
    ]
    assert starts.due(now=115.0) == []
    (line,) = starts.due(now=121.0)
    assert line[1] == "still starting vLLM engine: 21 s (Memory profiling takes 3.1 seconds)"
    starts.seen("rollout-0", "engine_started", now=125.0)
    assert starts.due(now=200.0) == []


def test_without_vllm_output_the_line_has_the_time_alone(tmp_path: Path) -> None:
    starts = EngineStarts(tmp_path)
    starts.seen("rollout-1", "engine_starting", now=0.0)
    assert starts.due(now=12.0) == [("rollout-1", "still starting vLLM engine: 12 s")]


def _console(tmp_path: Path) -> tuple[Console, io.StringIO]:
    console = Console(tmp_path, load_config("configs/tiny_cpu.yaml", []))
    buf = io.StringIO()
    console.out = RichConsole(file=buf, highlight=False, soft_wrap=True, width=300)
    return console, buf


def test_the_console_ticks_while_an_engine_starts(tmp_path: Path) -> None:
    console, buf = _console(tmp_path)
    console.show({"level": "info", "event": "engine_starting", "role": "rollout", "rank": 0, "model": "m"})
    console.engines.starting["rollout-0"].said -= EVERY_S  # ten seconds went by
    console.engines.starting["rollout-0"].began -= EVERY_S
    console.tick()
    assert buf.getvalue().splitlines()[-1].startswith("rollout-0 still starting vLLM engine: 10 s")


def test_once_stopping_no_ready_and_no_start_up_progress_is_printed(tmp_path: Path) -> None:
    """`controller-0 ready` and `reward-0 ready` came after `interrupted: stopping every role`."""
    console, buf = _console(tmp_path)
    console.show({"level": "info", "event": "engine_starting", "role": "rollout", "rank": 0, "model": "m"})
    console.stopping = True
    console.show({"level": "info", "event": "ready", "role": "controller", "rank": 0, "pid": 1})
    console.show({"level": "info", "event": "engine_started", "role": "rollout", "rank": 0, "seconds": 3})
    console.show({"level": "error", "event": "fatal", "role": "reward", "rank": 0, "cause": "x"})
    console.engines.seen("rollout-1", "engine_starting", now=0.0)  # long ago: a line is due
    console.tick()
    out = buf.getvalue()
    assert "ready" not in out and "still starting" not in out and "reward-0 error fatal" in out
