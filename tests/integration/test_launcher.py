"""The launcher with real role processes: fast config errors, readiness, teardown on a
SIGKILLed role (within 5 s, cause printed, nothing left behind), and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
TANDEM = [sys.executable, "-m", "runtime.cli"]


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    cmd = [*TANDEM, "launch", "configs/tiny_cpu.yaml", f"run_dir={run_dir}", "trainer.total_steps=100000", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ready(run_dir: Path, name: str, proc: subprocess.Popen[str], timeout: float = 240) -> int:
    """The pid of role `name` once it logged "ready"."""
    path = run_dir / "logs" / f"{name}.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["event"] == "ready":
                    return int(rec["pid"])
        time.sleep(0.1)
    raise AssertionError(f"{name} not ready after {timeout}s")


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def assert_all_gone(procs: list[psutil.Process]) -> None:
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_version() -> None:
    out = subprocess.run([*TANDEM, "--version"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("tandem ")


def test_unknown_key_fails_fast_naming_it(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "tandem"
    cmd = [str(exe)] if exe.exists() else TANDEM
    start = time.monotonic()
    argv = [*cmd, "launch", "configs/tiny_cpu.yaml", "foo.bar=1"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    assert out.returncode == 2
    assert "foo.bar" in out.stderr and "\n" not in out.stderr.strip()
    assert elapsed < 2.0, elapsed


def test_bad_value_names_key_and_choices() -> None:
    argv = [*TANDEM, "launch", "configs/tiny_cpu.yaml", "fsdp.sharding_strategy=SOMETIMES"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2
    assert "fsdp.sharding_strategy" in out.stderr and "FULL_SHARD" in out.stderr


# Every role goes through the same supervision path; these three cover the trainer rank the
# campaign found slow (7.0 s), the controller (the others must notice) and the rollout
# (vLLM's engine processes under it). benchmarks/faults.py measures all five.
@pytest.mark.parametrize("victim", ["trainer-0", "controller-0", "rollout-0"])
def test_sigkill_of_any_role_ends_the_run(tmp_path: Path, victim: str) -> None:
    proc = launch(tmp_path / "run")
    try:
        pid = wait_ready(tmp_path / "run", victim, proc)
        everything = tree(proc.pid)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    # About 2.3 s on an idle 2-core box (0.4 s for the rollout), 5.6 s once under the whole
    # suite on 2 cores: the bound tells "ends within seconds" from a hang, not a fast teardown.
    assert elapsed < 15.0, elapsed
    assert f"role {victim} died (killed by SIGKILL)" in out, out[-3000:]
    time.sleep(0.2)
    assert_all_gone(everything)


def test_sigkill_of_the_launcher_leaves_no_process_behind(tmp_path: Path) -> None:
    """Roles (and vLLM's engine processes under the rollout) die with their launcher."""
    proc = launch(tmp_path / "run")
    try:
        wait_ready(tmp_path / "run", "rollout-0", proc)
        everything = tree(proc.pid)
        assert len(everything) > 6  # launcher, 5 roles, and vLLM's engine processes
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(
            p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everything
        ):
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_all_gone(everything)


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    # On TCP rather than ipc sockets, so that one run covers the controller serving on the
    # port the launcher bound and handed over (runtime.launch.rendezvous) with every role reaching it.
    proc = launch(tmp_path / "run", "transport.use_ipc=false")
    try:
        for name in ("controller-0", "reward-0", "trainer-0", "trainer-1"):
            wait_ready(tmp_path / "run", name, proc)
        log = (tmp_path / "run" / "logs" / "controller-0.jsonl").read_text().splitlines()
        listening = next(json.loads(ln) for ln in log if '"controller_listening"' in ln)
        assert listening["address"].startswith("tcp://127.0.0.1:"), listening
        everything = tree(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out
    time.sleep(0.2)
    assert_all_gone(everything)


def test_a_role_whose_log_cannot_be_written_dies_saying_so(tmp_path: Path) -> None:
    """A full disk used to end a run with "last error: no error was
    logged". The controller's next log line fails (its file-size limit is set to the
    file's size: the same OSError path as ENOSPC); it dies naming the file, and the
    launcher learns the cause through the last-words pipe, not the disk."""
    import resource

    run = tmp_path / "run"
    proc = launch(run)
    try:
        pid = wait_ready(run, "controller-0", proc)
        size = (run / "logs" / "controller-0.jsonl").stat().st_size
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, size))
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    line = next((ln for ln in out.splitlines() if "role controller-0 died" in ln), out[-3000:])
    assert "last error: I/O error writing its log" in line and "controller-0.jsonl: File too large" in line, line
