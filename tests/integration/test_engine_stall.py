"""A wedged vLLM engine ends the run: SIGSTOP of the rollout's engine
processes, the rollout role itself alive and heartbeating, used to hang the run forever.
Now the rollout notices that samples are in flight and no engine step comes for
`rollout.stall_timeout_s`, reports itself dead with that cause, and the launcher stops the
run naming it, within the timeout and a margin."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT
from tests.integration.test_launcher import wait_ready

pytestmark = pytest.mark.slow
STALL_S = 15.0  # a warm engine's step on a busy 2-core machine is well under this


def test_a_wedged_engine_ends_the_run_naming_the_stall(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", f"run_dir={run}",
        "trainer.total_steps=100000", f"rollout.stall_timeout_s={STALL_S}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rollout = wait_ready(run, "rollout-0", proc)
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never trained"
            time.sleep(0.2)
        engine = psutil.Process(rollout).children(recursive=True)
        assert engine, "vLLM's engine processes"
        for p in engine:
            p.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        stdout, _ = proc.communicate(timeout=STALL_S + 60)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stdout[-3000:]
    assert "role rollout-0 died" in stdout and "made no progress" in stdout, stdout[-3000:]
    # Detection within the stall timeout plus the watchdog's tick and a step's length;
    # teardown within the launcher's bounds.
    assert took < STALL_S + 30, took
    print(f"\nengine frozen -> run ended in {took:.1f} s (stall_timeout_s={STALL_S:g})")
