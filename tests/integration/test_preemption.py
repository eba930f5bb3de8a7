"""A run stopped from outside, or by its disk, loses at most the step in flight and says how
to go on, with real tiny runs:

* SIGTERM to the launcher mid-run, defaults only: the step in flight finishes, a checkpoint
  of it is saved, every process is gone within checkpoint.preempt_grace_s; the last lines
  name the checkpoint and the resume command, launcher-0.jsonl records the interruption,
  and that command continues the run with metrics.jsonl holding every step once. The
  resumed run's summary comes right after its last step with the same wall time, and the
  run directory keeps no launch.lock and no started/.
* A checkpoint save into a full file system (a tmpfs in a user and mount namespace) ends
  the run within 30 s naming the folder and ENOSPC and the last intact checkpoint, from
  which the run resumes.
* Launches refused before anything starts (exit 2, one line): every prompt too long, no
  room for a checkpoint, a directory whose first launch crashed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.test_launcher import assert_all_gone, tree, wait_ready

TANDEM = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml"]
NAMESPACES = (
    shutil.which("unshare") is not None
    and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
)
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="needs unprivileged user and mount namespaces")


def metric_steps(run: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines() if '"kind"' not in ln]


def seconds(clock: str) -> int:
    """`1m03s` (runtime/views/wall_clock.py's format) in seconds."""
    h, _, rest = clock.rpartition("h")
    m, _, sec = rest.rpartition("m")
    return int(h or 0) * 3600 + int(m or 0) * 60 + int(sec.rstrip("s"))


class Lines:
    """A process's stdout lines, each with the time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "\n".join(line for _, line in self.lines)


@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_the_printed_command_resumes_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen([*TANDEM, f"run_dir={run}", "trainer.total_steps=1000"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out = Lines(proc)
    try:
        wait_ready(run, "rollout-0", proc)
        while not (run / "metrics.jsonl").exists() or len(metric_steps(run)) < 4:
            assert proc.poll() is None, out.text()[-3000:]
            time.sleep(0.1)
        everything = tree(proc.pid)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.text()
    print(json.dumps({"sigterm_to_exit_s": round(took, 2)}))
    assert proc.returncode == 130, text[-3000:]
    assert took < 60, took  # checkpoint.preempt_grace_s, the default
    time.sleep(0.2)
    assert_all_gone(everything)
    trained = metric_steps(run)[-1]
    saved = run / "checkpoints" / f"step-{trained:08d}"
    assert f"tandem: interrupted (SIGTERM) at step {trained}: saved checkpoint {saved}" in text, text[-3000:]
    command = next(ln for ln in text.splitlines() if ln.startswith("tandem: resume with: "))
    assert command.endswith(f"run_dir={run} trainer.total_steps=1000 resume=auto"), command
    log = [json.loads(ln) for ln in (run / "logs" / "launcher-0.jsonl").read_text().splitlines()]
    assert any(e["event"] == "interrupted" and e["signal"] == "SIGTERM" for e in log)
    (ended,) = [e for e in log if e["event"] == "run_interrupted"]
    assert ended["checkpoint"] == str(saved) and ended["resume"] == command.removeprefix("tandem: resume with: ")
    assert not (run / "launch.lock").exists() and not (run / "started").exists()

    # The printed command, with a nearer end, continues the run.
    again = [*shlex.split(command.removeprefix("tandem: resume with: ")), f"trainer.total_steps={trained + 3}"]
    proc = subprocess.Popen(again, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(proc)
    proc.wait(timeout=600)
    text = out.text()
    assert proc.returncode == 0, text[-3000:]
    assert f"tandem: resuming from {saved} (step {trained}, version {trained})" in text
    assert not any("[info" in ln for ln in text.splitlines())  # every line in the console's format
    assert metric_steps(run) == list(range(1, trained + 4))
    # The summary: right after the last step (the roles' shutdown after it), with its wall time.
    last = max(i for i, (_, ln) in enumerate(out.lines) if ln.startswith(f"step {trained + 3}/"))
    done = next(i for i, (_, ln) in enumerate(out.lines) if ln.startswith("tandem: finished: "))
    waited = out.lines[done][0] - out.lines[last][0]
    print(json.dumps({"last_step_to_finished_s": round(waited, 2)}))
    assert waited < 10, waited  # the final checkpoint (0.3 s) and the first role's exit; 20 s of silence before
    step_wall = seconds(out.lines[last][1].split(" wall ")[1].split()[0])
    summary = out.lines[done][1]
    assert summary.startswith("tandem: finished: wall ") and f", step {trained + 3}," in summary, summary
    assert 0 <= seconds(summary.split()[3].rstrip(",")) - step_wall <= 1.5, (summary, step_wall)  # + the final save
    assert not (run / "launch.lock").exists() and not (run / "started").exists()


FULL_DISK = """
set -u
mount -t tmpfs -o size=8M tmpfs "$RUN/checkpoints"
"$@" trainer.total_steps=8 checkpoint.every=2 > "$RUN.first" 2>&1
echo "first=$? at=$(date +%s.%N)"
ls "$RUN/checkpoints"
mount -o remount,size=64M "$RUN/checkpoints"
"$@" trainer.total_steps=6 checkpoint.every=2 resume=auto > "$RUN.second" 2>&1
echo "second=$?"
"""


@pytest.mark.slow
@needs_namespaces
def test_a_full_disk_at_a_save_ends_the_run_at_once_and_the_run_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cmd = ["unshare", "-rm", "sh", "-c", FULL_DISK, "sh", *TANDEM, f"run_dir={run}"]
    env = {**os.environ, "RUN": str(run)}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    first = Path(f"{run}.first").read_text()
    assert "first=1" in result.stdout and "second=0" in result.stdout, result.stdout + result.stderr + first[-3000:]
    assert result.stdout.split("first=1")[1].split()[1:2] == ["step-00000002"], result.stdout  # step 4's never was
    line = next(ln for ln in first.splitlines() if "role controller-0 died" in ln)
    assert f"checkpoint of step 4 into {run / 'checkpoints'} failed: No space left on device (ENOSPC)" in line, line
    assert f"the last intact checkpoint is {run / 'checkpoints' / 'step-00000002'}" in line, line
    failed = [json.loads(ln) for ln in (run / "logs" / "trainer-0.jsonl").read_text().splitlines()]
    failed_at = next(e["ts"] for e in failed if e["event"] == "checkpoint_save_failed")
    ended_at = float(result.stdout.split("at=")[1].split()[0])
    print(json.dumps({"enospc_save_to_exit_s": round(ended_at - failed_at, 2)}))
    assert ended_at - failed_at < 30, ended_at - failed_at
    second = Path(f"{run}.second").read_text()
    assert f"resuming from {run / 'checkpoints' / 'step-00000002'} (step 2" in second, second[-3000:]
    assert metric_steps(run) == list(range(1, 7))


def refused(tmp_path: Path, *overrides: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    run = tmp_path / "run"
    return subprocess.run([*(prefix or []), *TANDEM, f"run_dir={run}", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_every_prompt_too_long_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Once found 53 s in, after the engine started (exit 1); now exit 2, one line, no role started."""
    started = time.monotonic()
    out = refused(tmp_path, "data.max_prompt_tokens=5")
    took = time.monotonic() - started
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert "every prompt of the synthetic data (4096 rows) is longer than data.max_prompt_tokens=5" in out.stderr
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "config.yaml").exists()
    assert took < 60, took  # the tiny model is made and its tokenizer loaded; no role starts


def test_a_directory_whose_first_launch_crashed_is_not_reused(tmp_path: Path) -> None:
    """The second launch used to overwrite config.yaml and append to the first one's logs."""
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "launcher-0.jsonl").write_text('{"event": "launching"}\n')
    (tmp_path / "run" / "config.yaml").write_text("name: first\n")
    out = refused(tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "holds an earlier run (logs/launcher-0.jsonl): continue it with resume=auto" in out.stderr
    assert (tmp_path / "run" / "config.yaml").read_text() == "name: first\n"


@needs_namespaces
def test_no_room_for_a_checkpoint_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    mount = f'mount -t tmpfs -o size=1M tmpfs {tmp_path / "run" / "checkpoints"} && exec "$@"'
    out = refused(tmp_path, prefix=["unshare", "-rm", "sh", "-c", mount, "sh"])
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stdout[-2000:] + out.stderr
    assert "no room for a checkpoint: one takes about 4.6 MB and the file system of" in out.stderr, out.stderr
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.slow
def test_while_vllm_starts_the_console_says_so_and_a_sigterm_stops_it_at_once(tmp_path: Path) -> None:
    """After `rollout-0 starting vLLM engine` nothing was printed for 94-179 s; a SIGTERM then
    took 10.2 s (the launcher waited out shutdown_timeout_s for a role finishing its set-up),
    and `controller-0 ready` / `reward-0 ready` came after `interrupted: stopping every role`."""
    run = tmp_path / "run"
    proc = subprocess.Popen([*TANDEM, f"run_dir={run}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out = Lines(proc)
    try:
        deadline = time.monotonic() + 240
        while not any("rollout-0 starting vLLM engine" in ln for _, ln in out.lines):
            assert proc.poll() is None and time.monotonic() < deadline, out.text()[-3000:]
            time.sleep(0.1)
        began = next(t for t, ln in out.lines if "rollout-0 starting vLLM engine" in ln)
        while time.monotonic() < began + 11 and not any("engine ready" in ln for _, ln in out.lines):
            time.sleep(0.1)
        everything = tree(proc.pid)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.text()
    print(json.dumps({"sigterm_before_first_step_to_exit_s": round(took, 2)}))
    assert proc.returncode == 130, text[-3000:]
    # A start on 2 loaded cores takes 15-60 s, so the engine is still starting at 11 s there;
    # on a faster machine that finished first, the lines are tests/unit/runtime/views/test_startup.py's.
    lines = [ln for t, ln in out.lines if t < sent]
    if not any("engine ready" in ln for ln in lines):
        assert any(re.match(r"rollout-0 still starting vLLM engine: 1\d s", ln) for ln in lines), text[-3000:]
    assert took < 5.0, (took, text[-3000:])  # was 10.2 s; a second or two here, 5 s for a loaded CI machine
    after = text.split("tandem: interrupted", 1)[1]
    assert " ready" not in after and "still starting" not in after, after
    time.sleep(0.2)
    assert_all_gone(everything)
