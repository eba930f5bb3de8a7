"""`tandem watch RUN > file` (output not a terminal) prints one frame and says it did so,
instead of redrawing a live view nobody sees (0 bytes, forever); a `--once` frame does not
say how to quit a view that has already ended."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

RECORDED = ROOT / "tests" / "data" / "tiny_run"


def watch(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "runtime.cli", "watch", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_watch_into_a_file_prints_one_frame_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "frame.txt"
    with open(out, "w") as f:
        done = subprocess.run([sys.executable, "-m", "runtime.cli", "watch", str(RECORDED)], cwd=ROOT, stdout=f,
                              stderr=subprocess.PIPE, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "step 40/40" in text and "reward ~" in text and "(q or Ctrl-C quits)" not in text
    assert "not a terminal" in done.stderr and "--once" in done.stderr


def test_a_once_frame_does_not_say_how_to_quit() -> None:
    done = watch("--once", str(RECORDED))
    assert done.returncode == 0, done.stderr
    assert "step 40/40" in done.stdout and "quits" not in done.stdout
    assert done.stderr == ""
