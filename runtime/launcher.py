"""`tandem launch`: spawn this node's role processes, watch them, tear down cleanly.

Guarantees:
* Every role runs in its own session (process group) with PR_SET_PDEATHSIG, so a
  teardown kills the role and everything it spawned (vLLM's engine processes
  included), and a launcher that is killed takes its roles with it (each role's orphan
  watchdog then kills its whole process group within a few seconds).
* A role that exits 0 is finishing cleanly (the controller ends the run by telling
  every role to stop): the others get `shutdown_timeout_s` to do the same, then the
  launcher exits 0.
* The first role to exit otherwise (non-zero code or a signal) ends the run: the
  launcher prints which role died and its last logged error, stops all others
  (SIGTERM, then SIGKILL after a short grace) and exits 1 — within seconds.
* Ctrl-C stops everything the same way and exits 130.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from runtime import addresses, base_model, checkpoint, last_words
from runtime.checkpoint_layout import cannot_serve, check_adapter_rank, check_resume_layout
from runtime.config import RunConfig
from runtime.config_load import ConfigError, to_yaml
from runtime.console import Console
from runtime.gpu_check import check_gpu_devices
from runtime.last_words import LastWords
from runtime.launcher_env import ROLE_ENV_DEFAULTS
from runtime.launcher_options import LaunchOptions
from runtime.logfollow import LogFollower, last_error
from runtime.logs import get_logger, setup_logging
from runtime.memory_model import ShapeError
from runtime.memory_plan import Plan, check_plan, format_plan, launch_plan, plan_rows, plan_summary
from runtime.paths import model_dir, reward_model_dir
from runtime.placement import ProcSpec, check_devices, plan_join, plan_processes, visible_gpus, wants_gpus
from runtime.process_groups import wait_gone
from runtime.rendezvous import inherited_fds, listen_for_controller, listen_for_worlds
from runtime.run_dir import check_run_dir, lock_run_dir
from runtime.run_token import ensure_token
from runtime.start_order import clear_started
from runtime.summary import end_summary
from runtime.tiny_model import make_tiny_model
from runtime.wall_clock import record_end, record_start, wall_label

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


def prepare_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    ensure_token(run_dir)
    clear_started(run_dir)  # a colocated trainer waits for this launch's rollouts, not a mark left before
    t = msgspec.structs.asdict(cfg.model.tiny)
    if not cfg.model.path:
        make_tiny_model(model_dir(cfg), **t)
    if cfg.reward.model.path == "tiny":  # the policy's shape, another seed
        make_tiny_model(reward_model_dir(cfg), **{**t, "seed": t["seed"] + 1}, classifier=True)
    return run_dir


def launch(cfg: RunConfig, opts: LaunchOptions | None = None, *, quiet: bool = False) -> int:
    """Run this node's share of the run; returns the process exit code. `quiet`: print
    errors only (to stderr)."""
    opts = opts or LaunchOptions()
    gpus = wants_gpus(cfg)
    num_gpus = visible_gpus() if gpus else 0  # asks torch once, only when GPUs are asked for
    if gpus:
        check_gpu_devices(cfg, num_gpus, opts.node_rank)  # before the model is made: a missing GPU fails at once
    plan = _memory_plan(cfg, gpus)  # before any role starts: a run that cannot fit is refused here
    if quiet:
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' "Writing model shards" bars
    console = Console(Path(cfg.run_dir), cfg, quiet=quiet)
    resume = ""
    if opts.node_rank == 0 and not opts.join:  # other nodes join node 0's run (the directory may be shared)
        lock_run_dir(Path(cfg.run_dir))
        for line in check_run_dir(cfg):
            console.note(f"resume=fresh: moved {line}")
    if cfg.resume == "auto":
        found = _resume_from(cfg, console)  # before the run dir is prepared: a refusal changes nothing there
        if found is None:
            return 0
        resume = found
    run_dir = prepare_run_dir(cfg)
    if opts.node_rank == 0 and not opts.join:  # the run's one wall clock starts when this launcher did
        record_start(run_dir, time.time() - (time.monotonic() - console.started), continued=bool(resume))
    setup_logging(run_dir, "launcher", opts.node_rank, level=cfg.log_level)
    if plan is not None:
        log.info("memory_plan", rows=plan_rows(plan), table=format_plan(plan).splitlines())
    check_topology(cfg, opts)
    if opts.join:
        specs = plan_join(cfg, opts.node_rank)
    else:
        rendezvous = opts.master_port + 1 if opts.master_port else 0
        specs = plan_processes(cfg, opts.node_rank, master_addr=opts.master_addr, master_port=rendezvous)
    listeners = [] if opts.join or opts.master_port else listen_for_worlds(specs, opts.master_addr)
    controller_port = opts.master_port
    if not (opts.join or opts.master_port) and (opts.nnodes > 1 or not cfg.transport.use_ipc):  # TCP: hold it too
        listeners.append(listen_for_controller(specs, cfg.transport.bind_host))
        controller_port = listeners[-1].getsockname()[1]
    if any(s.devices for s in specs):
        check_devices(specs, num_gpus)  # the processes actually planned (a --join launcher's too)
    env = _base_env(cfg, run_dir, opts, controller_port)
    if cfg.resume == "auto":
        env[checkpoint.RESUME_ENV] = resume
    log.info(
        "launching",
        node=opts.node_rank,
        processes=[s.name for s in specs],
        run_dir=str(run_dir),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )  # what placement's `devices` index
    console.note(f"run {cfg.name}: {len(specs)} processes, logs in {run_dir / 'logs'}")
    if plan is not None and plan.gpu_gb:
        console.note(plan_summary(plan))
        for line in plan.chosen:  # what `auto` became for this GPU, and why (config.yaml keeps it: memory.chosen)
            console.note(f"auto: {line}")
    follower = LogFollower(run_dir / "logs", from_end=True)
    procs = [_spawn(s, run_dir, env) for s in specs]
    for sock in listeners:  # the process serving each one has its own copy now
        sock.close()
    return Supervisor(cfg, run_dir, procs, console, follower).watch()


def _memory_plan(cfg: RunConfig, gpus: bool) -> Plan | None:
    """The run's memory plan, checked unless `memory.check` is off (None: the model's shape
    is unknown, so nothing is planned)."""
    try:
        plan = launch_plan(cfg, asks_gpus=gpus)
    except ShapeError as exc:
        print(f"tandem: warning: no memory plan: {exc}", file=sys.stderr)
        return None
    if cfg.memory.check:
        check_plan(cfg, plan)
    return plan


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
        self.interrupted = False

    def watch(self) -> int:
        old = signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, self._on_sigint)
        start = time.monotonic()
        try:
            while True:
                self._pump_logs()
                if self.interrupted:
                    self.console.note("interrupted: stopping every role")
                    self.teardown(self.cfg.shutdown_timeout_s)
                    return 130
                code = self._check_exits()
                if code is not None:
                    return code
                if not all(p.ready for p in self.procs) and time.monotonic() - start > self.cfg.startup_timeout_s:
                    late = [p.spec.name for p in self.procs if not p.ready]
                    self.console.error(f"roles not ready after {self.cfg.startup_timeout_s:g}s: {', '.join(late)}")
                    self.teardown(FAILURE_GRACE_S)
                    return 1
                time.sleep(POLL_S)
        finally:
            signal.signal(signal.SIGINT, old)

    def _on_sigint(self, *_: object) -> None:
        self.interrupted = True

    def _pump_logs(self) -> None:
        for rec in self.follower.poll():
            if rec.get("event") == "ready":
                for p in self.procs:
                    if p.spec.role == rec.get("role") and p.spec.rank == rec.get("rank"):
                        p.ready = True
            self.console.show(rec)

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
                self._wait_all(self.cfg.shutdown_timeout_s)
                self.teardown(self.cfg.shutdown_timeout_s)
                self._pump_logs()
                self.console.finish()
                for line in end_summary(self.run_dir, wall_label(record_end(self.run_dir))):
                    self.console.note(line)
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
            return 1
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


def check_topology(cfg: RunConfig, opts: LaunchOptions) -> None:
    """Cross-host runs must authenticate and must bind somewhere other hosts can reach."""
    if cfg.transport.curve:
        from transport.security import load_keys

        try:
            load_keys(cfg.transport.keys_dir or Path(cfg.run_dir) / "keys")
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"transport.curve=true: {exc}") from None
    if opts.nnodes <= 1 and not opts.join:
        return
    if not cfg.transport.curve:
        raise ConfigError("cross-host runs need transport.curve=true (make keys with `tandem keys RUN_DIR`)")
    if cfg.transport.bind_host in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(
            "transport.bind_host=127.0.0.1 is unreachable from other nodes: set transport.bind_host=0.0.0.0 "
            "or this node's address"
        )


def _resume_from(cfg: RunConfig, console: Console) -> str | None:
    """The newest intact checkpoint of the run ("" for a fresh start), chosen once per node;
    None when the run is already finished (nothing to train: the launcher exits 0). A
    ConfigError when no intact checkpoint can serve this config, or when the base model changed."""
    found = checkpoint.find_latest(cfg.run_dir, required=checkpoint.required_parts(cfg))
    if found is None:
        intact = checkpoint.find_latest(cfg.run_dir, quiet=True)
        if intact is not None:
            raise ConfigError(f"resume=auto: {cannot_serve(intact[0], cfg)}; or start over with resume=fresh")
        console.note("resume=auto: no complete checkpoint, starting fresh")
        return ""
    path, manifest = found
    try:
        check_resume_layout(path, cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    problem = check_adapter_rank(path, cfg) or _base_changed(cfg, path, manifest)
    if problem:
        raise ConfigError(f"resume=auto: {problem}; or start over with resume=fresh")
    if manifest["step"] >= cfg.trainer.total_steps:
        console.note(
            f"resume=auto: the run is finished: {path} is step {manifest['step']}, trainer.total_steps is "
            f"{cfg.trainer.total_steps}; nothing to train (raise trainer.total_steps to train on)"
        )
        return None
    console.note(f"resuming from {path} (step {manifest['step']}, version {manifest['version']})")
    log.info("resuming", checkpoint=str(path), step=manifest["step"])
    return str(path.resolve())


def _base_changed(cfg: RunConfig, path: Path, manifest: dict[str, Any]) -> str:
    """ "" when this launch trains the base model `path` was trained on. The tiny model is
    judged as it will be made: made in a scratch copy first, since its arguments may differ
    from the one in the run dir (which a resume must not replace)."""
    if cfg.model.path or not manifest.get(base_model.MANIFEST_KEY):
        return base_model.mismatch(path, manifest, model_dir(cfg))
    with tempfile.TemporaryDirectory(prefix="tandem-model-") as tmp:
        scratch = Path(tmp) / "model"
        if model_dir(cfg).is_dir():
            shutil.copytree(model_dir(cfg), scratch)
        make_tiny_model(scratch, **msgspec.structs.asdict(cfg.model.tiny))  # a no-op when the arguments match
        problem = base_model.mismatch(path, manifest, scratch)
    return problem.replace(str(scratch.resolve()), str(model_dir(cfg).resolve()) + " (as model.tiny makes it)")


def _spawn(spec: ProcSpec, run_dir: Path, base_env: dict[str, str]) -> Proc:
    words = LastWords()
    env = {**base_env, **spec.env, last_words.ENV: str(words.write_fd)}
    out = open(run_dir / "logs" / f"{spec.name}.out", "ab")  # noqa: SIM115 (owned by the child)
    cmd = [sys.executable, "-m", "runtime.entry", "--run-dir", str(run_dir), "--role", spec.role]
    cmd += ["--rank", str(spec.rank), "--node", str(spec.node)]
    popen = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True, preexec_fn=_die_with_parent, pass_fds=(words.write_fd, *inherited_fds(spec)),
    )  # fmt: skip
    out.close()
    words.child_started()
    log.info("spawned", proc=spec.name, pid=popen.pid)
    return Proc(spec=spec, popen=popen, words=words)


def _base_env(cfg: RunConfig, run_dir: Path, opts: LaunchOptions, port: int) -> dict[str, str]:
    """Every role's environment; `port` is the controller's TCP port (0 on ipc)."""
    env = {**ROLE_ENV_DEFAULTS, **os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    env["TANDEM_NNODES"] = str(opts.nnodes)
    env["TANDEM_JOIN"] = opts.join
    env["TANDEM_CONTROLLER_PORT"] = str(port)
    if opts.join:
        env[addresses.CONTROLLER_ENV] = opts.join if "://" in opts.join else f"tcp://{opts.join}"
    elif opts.nnodes > 1:
        env[addresses.CONTROLLER_ENV] = f"tcp://{opts.master_addr}:{port}"
    elif cfg.transport.use_ipc:
        env[addresses.CONTROLLER_ENV] = addresses.controller_bind_address(cfg, run_dir)
    else:
        env[addresses.CONTROLLER_ENV] = f"tcp://{opts.master_addr}:{port}"
    if opts.nnodes > 1 or opts.join:
        target = opts.join.split("://")[-1].rsplit(":", 1)[0] if opts.join else opts.master_addr
        env.setdefault("TANDEM_ADVERTISE_HOST", addresses.advertise_host(cfg.transport.bind_host, target))
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _die_with_parent() -> None:
    # SIGTERM, not SIGKILL: the role then stops its own children (vLLM's engine processes)
    # too; its orphan watchdog (runtime.role) kills its whole process group if it lingers.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(p: Proc, sig: signal.Signals) -> None:
    try:
        os.killpg(p.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
