"""`tandem watch` in a real terminal: under tmux the pane shows the role table and the
training panel, and `q` or Ctrl-C quits it with exit code 0."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.runtime.views.test_watch import live_run

TMUX = shutil.which("tmux")


def tmux(session: str, *args: str) -> list[str]:
    """A tmux command on the session's own server (`-L`): a shared default server exits when
    one test kills its last session, and the next test's `new-session` can meet it going
    ("server exited unexpectedly", seen in a fresh-clone suite)."""
    return ["tmux", "-L", session, *args]


def pane(session: str) -> str:
    return subprocess.run(tmux(session, "capture-pane", "-p", "-t", session), capture_output=True, text=True).stdout


def wait_for(session: str, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = pane(session)
        if text in shown:
            return shown
        time.sleep(0.3)
    raise AssertionError(f"{text!r} never appeared; the pane shows:\n{pane(session)}")


@pytest.mark.parametrize(("key", "width"), [("q", 150), ("C-c", 80)])
def test_watch_under_tmux_shows_the_role_table_and_quits_on_q_or_ctrl_c(tmp_path: Path, key: str, width: int) -> None:
    """At 80 columns, too: role names were cut there (`controlle…`)."""
    if TMUX is None:
        pytest.fail("no tmux on PATH: run .ci/setup --tests (it installs the Debian package `tmux`)")
    run = live_run(tmp_path, metrics_lines=20)
    session = f"tandem-watch-{uuid.uuid4().hex[:8]}"
    cmd = f"cd {ROOT} && {sys.executable} -m runtime.cli watch {run} --interval 0.5; echo EXITED $?; sleep 60"
    subprocess.run(tmux(session, "new-session", "-d", "-s", session, "-x", str(width), "-y", "45", cmd), check=True)
    try:
        shown = wait_for(session, "samples/s ~")
        for expected in ("roles", "controller-0", "rollout-0", "alive", "version", "flight", "steps/min"):
            assert expected in shown, expected
        assert "…" not in shown, shown
        subprocess.run(tmux(session, "send-keys", "-t", session, key), check=True)
        wait_for(session, "EXITED 0", timeout_s=15)
    finally:
        subprocess.run(tmux(session, "kill-server"), capture_output=True)
