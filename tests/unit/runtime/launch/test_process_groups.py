"""runtime.launch.process_groups on real processes: a group's live members, and waiting them out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from runtime.launch.process_groups import live_members, wait_gone

# A parent in its own session with a child that ignores SIGTERM: two live members.
SCRIPT = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
    "time.sleep(60)']); time.sleep(60)"  # fmt: skip


def test_a_group_counts_its_children_until_they_are_killed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(live_members(proc.pid)) < 2:
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        assert proc.pid in live_members(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)  # ignored by both
        assert set(wait_gone([proc.pid], 0.3)) == {proc.pid}
        os.killpg(proc.pid, signal.SIGKILL)
        # The parent is our child and stays a zombie until reaped: not counted as live.
        assert wait_gone([proc.pid], 10) == {}
        assert live_members(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()
