"""The launcher's watch over its role processes, and how a run ends (see runtime/launch/launcher.py
for the guarantees): a clean end (the summary at once, then the roles' own shutdown), a
role that dies (every other one stopped within seconds, the cause printed), a stop from
outside (SIGTERM or SIGINT: a checkpoint within `checkpoint.preempt_grace_s`, then the
checkpoint and the resume command), and the teardown that leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.config import RunConfig
from runtime.last_words import LastWords
from runtime.launch.interruption import interrupted_lines
from runtime.launch.placement import ProcSpec
from runtime.launch.process_groups import wait_gone
from runtime.logs import get_logger
from runtime.views.console import Console
from runtime.views.logfollow import LogFollower, last_error
from runtime.views.summary import end_summary
from runtime.views.wall_clock import record_end, wall_label

log = get_logger("launcher")
FAILURE_GRACE_S = 2.0
GROUP_EXIT_WAIT_S = 30.0  # after SIGKILL: how long the launcher waits for a role's children to be gone
POLL_S = 0.1


@dataclass
class Proc:
    spec: ProcSpec
    popen: subprocess.Popen[bytes]
    words: LastWords
    ready: bool = False


class Supervisor:
    """Watches the role processes and decides how the run ends."""

    def __init__(
        self, cfg: RunConfig, run_dir: Path, procs: list[Proc], console: Console, follower: LogFollower
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.procs = procs
        self.console = console
        self.follower = follower
        self.signals: list[str] = []  # the names of the stop signals received, in order
        self.interrupted_at = 0.0  # Unix time of the first one
        self.deadline: float | None = None  # monotonic: the grace's end, once a checkpoint was asked for
        self.training_done: float | None = None  # Unix time the controller logged the end of training
        self.summarized = False

    def watch(self) -> int:
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        start = time.monotonic()
        try:
            while True:
                self._pump_logs()
                if self.signals:
                    code = self._interrupted()
                    if code is not None:
                        return code
                code = self._check_exits()
                if code is not None:
                    return code
                self.console.tick()
                if not all(p.ready for p in self.procs) and time.monotonic() - start > self.cfg.startup_timeout_s:
                    late = [p.spec.name for p in self.procs if not p.ready]
                    self.console.error(f"roles not ready after {self.cfg.startup_timeout_s:g}s: {', '.join(late)}")
                    self.teardown(FAILURE_GRACE_S)
                    return 1
                time.sleep(POLL_S)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _: object) -> None:
        if not self.signals:
            self.interrupted_at = time.time()
        self.signals.append(signal.Signals(signum).name)

    def _interrupted(self) -> int | None:
        """Act on the stop signals (see the module docstring); the exit code once the run is
        stopped, None while the checkpoint is being saved."""
        grace = self.cfg.checkpoint.preempt_grace_s
        if self.deadline is None:
            how = self.signals[0]
            self.console.stopping = True  # no role's "ready" or start-up progress from here on
            log.info("interrupted", signal=how, grace_s=grace)  # the console says it in a sentence
            controller = next((p for p in self.procs if p.spec.role == "controller"), None)
            if grace > 0 and controller is not None and controller.ready and controller.popen.poll() is None:
                self.console.note(
                    f"interrupted ({how}): finishing the step in flight and saving a checkpoint, at most {grace:g}s "
                    "(press Ctrl-C again to stop at once)"
                )
                os.kill(controller.popen.pid, signal.SIGUSR1)
            elif grace > 0 and controller is None:  # a node without the controller: node 0's stops these roles
                self.console.note(f"interrupted ({how}): waiting for the run's controller to stop, at most {grace:g}s")
            else:
                return self._stop_now("stopping every role")
            self.deadline = time.monotonic() + max(0.0, grace - FAILURE_GRACE_S)
        if len(self.signals) > 1:
            return self._stop_now(f"{self.signals[-1]} again: stopping every role now")
        if time.monotonic() >= self.deadline:
            return self._stop_now(f"no clean stop within checkpoint.preempt_grace_s={grace:g}s: stopping every role")
        return None

    def _stop_now(self, why: str) -> int:
        self.console.note(f"interrupted: {why}")
        self.teardown(FAILURE_GRACE_S if self.deadline is not None else self.cfg.shutdown_timeout_s)
        self._pump_logs()
        return self._end_interrupted()

    def _end_interrupted(self) -> int:
        """The interrupted run's last lines: its checkpoint and the command that resumes it."""
        self.console.finish()
        record_end(self.run_dir)
        if self.procs and self.procs[0].spec.node == 0:
            lines, fields = interrupted_lines(self.cfg, self.signals[0], self.interrupted_at)
            for line in lines:
                self.console.note(line)
            log.warning("run_interrupted", **fields)
        return 130

    def _pump_logs(self) -> None:
        for rec in self.follower.poll():
            if rec.get("event") == "ready":
                for p in self.procs:
                    if p.spec.role == rec.get("role") and p.spec.rank == rec.get("rank"):
                        p.ready = True
            elif rec.get("event") == "training_done" and rec.get("role") == "controller":
                self.training_done = float(rec.get("ts") or time.time())
            if not self.summarized or rec.get("level") in ("error", "critical"):  # the summary ends the story
                self.console.show(rec)

    def _finished(self) -> None:
        """The end summary (once): the run's results are all written when training is done."""
        if self.summarized:
            return
        self.summarized = True
        self.console.finish()
        for line in end_summary(self.run_dir, wall_label(record_end(self.run_dir, self.training_done))):
            self.console.note(line)

    def _check_exits(self) -> int | None:
        # A role killed by a signal (SIGKILL, an abort) is the likelier first cause than
        # one that exited 1 because its peer vanished: report it first.
        for p in sorted(self.procs, key=lambda q: not ((q.popen.poll() or 0) < 0)):
            code = p.popen.poll()
            if code is None:
                continue
            if code == 0:
                # A clean exit means the run is ending (the controller finished, or told
                # this role to stop): give the others time to finish the same way.
                self._pump_logs()
                if self.training_done is not None and not self.signals:
                    self._finished()  # at once: the roles' own shutdown is no part of the run
                left = self.cfg.shutdown_timeout_s
                if self.deadline is not None:  # what is left of the grace
                    left = max(0.5, min(left, self.deadline + FAILURE_GRACE_S - time.monotonic()))
                for q in self.procs:  # one still setting up (a vLLM engine starting) has nothing to finish
                    if not q.ready and q.popen.poll() is None:
                        _signal_group(q, signal.SIGTERM)
                self._wait_all(left)
                self.teardown(left)
                self._pump_logs()
                if self.signals:
                    return self._end_interrupted()
                self._finished()
                log.info("run_finished", run_dir=str(self.run_dir), first_exit=p.spec.name)
                return 0
            self._pump_logs()
            cause = p.words.first_line() or last_error(self.run_dir / "logs", p.spec.name)
            how = _describe_exit(code)
            if p.spec.role == "rollout" and self.cfg.rollout.elastic and len(self.procs) > 1:
                # Elastic rollout workers may leave: the controller re-dispatches their work.
                log.warning("rollout_left", proc=p.spec.name, exit=how, cause=cause)
                self.console.note(f"rollout {p.spec.name} left ({how}); the run goes on without it")
                _signal_group(p, signal.SIGKILL)
                self.procs.remove(p)
                return None
            log.error("role_died", proc=p.spec.name, exit=how, cause=cause)
            self.console.error(f"role {p.spec.name} died ({how}); last error: {cause}")
            self.teardown(FAILURE_GRACE_S)
            return self._end_interrupted() if self.signals else 1
        return None

    def _wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in self.procs):
            time.sleep(0.05)

    def teardown(self, grace_s: float) -> None:
        """SIGTERM every live process group, wait up to `grace_s`, then SIGKILL."""
        live = [p for p in self.procs if p.popen.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        self._wait_all(grace_s)
        for p in self.procs:
            _signal_group(p, signal.SIGKILL)  # also reaps leftovers of roles that exited
        for p in self.procs:
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("process_unkillable", proc=p.spec.name, pid=p.popen.pid)
            p.words.close()
        # The roles' children (vLLM's engine processes) too: once the launcher returns, the
        # GPU memory of the run is free for the next one (a resume right after a crash).
        names = {p.popen.pid: p.spec.name for p in self.procs}
        for pgid, pids in wait_gone(names, GROUP_EXIT_WAIT_S).items():
            log.error("process_group_lingering", proc=names[pgid], pids=pids)


def _signal_group(p: Proc, sig: signal.Signals) -> None:
    try:
        os.killpg(p.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
