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
* SIGTERM or SIGINT (Ctrl-C; Slurm's warning before preemption) asks the controller for
  a checkpoint (SIGUSR1): the step whose batch is with the trainer finishes, a checkpoint
  of it is saved, every role stops, all within `checkpoint.preempt_grace_s`; the launcher
  then prints the checkpoint and the exact command that resumes from it
  (runtime/launch/interruption.py), records `run_interrupted` in launcher-0.jsonl and exits 130.
  A second signal, a grace of 0, or a run not yet stepping stops every role at once. Past
  the grace everything is stopped all the same (the line then names the last checkpoint).
* When training is done, the summary is printed at once (its wall time is the run's up to
  the end of training, as the step lines count it); the roles' own shutdown follows.
* A launcher that returns leaves no `launch.lock` and no `started/` marks behind.
"""

from __future__ import annotations

import ctypes
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from runtime import last_words
from runtime.checkpoints import base_model, checkpoint, resume_settings
from runtime.checkpoints.layout import cannot_serve, check_adapter_rank, check_resume_layout
from runtime.config import RunConfig
from runtime.config.load import to_yaml
from runtime.config.placement import wants_gpus
from runtime.data.prompts import check_prompt_lengths
from runtime.errors import ConfigError
from runtime.identity import addresses
from runtime.identity.paths import model_dir, reward_model_dir, teacher_dir
from runtime.identity.run_dir import check_run_dir, lock_run_dir, release_run_dirs, set_aside
from runtime.identity.run_token import ensure_token
from runtime.last_words import LastWords
from runtime.launch.env import ROLE_ENV_DEFAULTS
from runtime.launch.options import LaunchOptions
from runtime.launch.placement import ProcSpec, check_devices, plan_join, plan_processes, visible_gpus
from runtime.launch.rendezvous import inherited_fds, listen_for_controller, listen_for_worlds
from runtime.launch.start_order import clear_started
from runtime.launch.supervisor import Proc, Supervisor
from runtime.logs import get_logger, log_path, setup_logging
from runtime.memory.estimate import ShapeError
from runtime.memory.plan import Plan, check_plan, format_plan, launch_plan, plan_rows, plan_summary
from runtime.preflight.checkpoint_space import check_checkpoint_space
from runtime.preflight.gpus import check_gpu_devices
from runtime.preflight.teacher import check_teacher_tokenizer
from runtime.tiny.model import make_tiny_model
from runtime.tiny.teacher import make_tiny_teacher
from runtime.views.console import Console
from runtime.views.logfollow import LogFollower
from runtime.views.wall_clock import record_start

log = get_logger("launcher")


def make_models(cfg: RunConfig) -> None:
    """The tiny models the run trains (and scores with), made under the run directory: inputs,
    which a `resume=fresh` leaves in place."""
    t = msgspec.structs.asdict(cfg.model.tiny)
    if not cfg.model.path:
        make_tiny_model(model_dir(cfg), **t)
    if cfg.reward.model.path == "tiny":  # the policy's shape, another seed
        make_tiny_model(reward_model_dir(cfg), **{**t, "seed": t["seed"] + 1}, classifier=True)
    if cfg.algorithm.distill.teacher == "tiny":
        d = cfg.algorithm.distill
        make_tiny_teacher(teacher_dir(cfg), msgspec.structs.asdict(d.tiny), d.tiny_train_steps)


def prepare_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    ensure_token(run_dir)
    clear_started(run_dir)  # a colocated trainer waits for this launch's rollouts, not a mark left before
    make_models(cfg)
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
    early = io.StringIO()  # the launcher's log lines until its log file exists (then copied there)
    setup_logging(None, "launcher", opts.node_rank, level=cfg.log_level, stream=early)
    first = opts.node_rank == 0 and not opts.join  # other nodes join node 0's run (the directory may be shared)
    if first:
        lock_run_dir(Path(cfg.run_dir))
    try:
        return _launch(cfg, opts, console, plan, num_gpus, early)
    finally:
        if first:  # a finished launch leaves no lock and no start marks
            clear_started(Path(cfg.run_dir))
            release_run_dirs(remove=True)


def _launch(
    cfg: RunConfig, opts: LaunchOptions, console: Console, plan: Plan | None, num_gpus: int, early: io.StringIO
) -> int:
    resume = ""
    first = opts.node_rank == 0 and not opts.join
    if first:
        for line in check_run_dir(cfg):
            console.note(f"resume=fresh: moved {line}")
    if cfg.resume == "auto":
        found = _resume_from(cfg, console, set_aside_earlier=first)  # before the run dir is prepared
        if found is None:
            return 0
        resume = found
    if first:
        make_models(cfg)
        _check_before_start(cfg, plan)
    run_dir = prepare_run_dir(cfg)
    if first:  # the run's one wall clock starts when this launcher did
        record_start(run_dir, time.time() - (time.monotonic() - console.started), continued=bool(resume))
    setup_logging(run_dir, "launcher", opts.node_rank, level=cfg.log_level)
    with open(log_path(run_dir, "launcher", opts.node_rank), "a") as f:
        f.write(early.getvalue())
    if resume:
        log.info("resuming", checkpoint=resume)
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


def _check_before_start(cfg: RunConfig, plan: Plan | None) -> None:
    """What needs the model made: every prompt too long, no room for a checkpoint (ConfigError)."""
    from transformers import AutoTokenizer

    check_prompt_lengths(cfg, AutoTokenizer.from_pretrained(str(model_dir(cfg))))
    if cfg.algorithm.distill.enabled:
        check_teacher_tokenizer(model_dir(cfg), teacher_dir(cfg))
    if plan is not None:
        check_checkpoint_space(cfg, plan.shape)


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


def _resume_from(cfg: RunConfig, console: Console, *, set_aside_earlier: bool = False) -> str | None:
    """The newest intact checkpoint of the run ("" for a fresh start), chosen once per node;
    None when the run is already finished (nothing to train: the launcher exits 0). A
    ConfigError when no intact checkpoint can serve this config, or when the base model changed.
    With no checkpoint at all, `set_aside_earlier` (node 0) moves the earlier run's files
    aside as `resume=fresh` does: a fresh start never appends to another run's files."""
    found = checkpoint.find_latest(cfg.run_dir, required=checkpoint.required_parts(cfg))
    if found is None:
        intact = checkpoint.find_latest(cfg.run_dir, quiet=True)
        if intact is not None:
            raise ConfigError(f"resume=auto: {cannot_serve(intact[0], cfg)}; or start over with resume=fresh")
        console.note("resume=auto: no complete checkpoint, starting fresh")
        for line in set_aside(Path(cfg.run_dir)) if set_aside_earlier else []:
            console.note(f"resume=auto: moved {line}")
        return ""
    path, manifest = found
    try:
        check_resume_layout(path, cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    refused, accepted = resume_settings.compare(
        manifest.get(resume_settings.MANIFEST_KEY), resume_settings.settings(cfg)
    )
    if refused:
        raise ConfigError(f"resume=auto: {path.name}: {refused}")
    problem = check_adapter_rank(path, cfg) or _base_changed(cfg, path, manifest)
    if problem:
        raise ConfigError(f"resume=auto: {problem}; or start over with resume=fresh")
    if accepted:
        console.note(f"resume=auto: changed settings taken as given: {accepted}")
    if manifest["step"] >= cfg.trainer.total_steps:
        console.note(
            f"resume=auto: the run is finished: {path} is step {manifest['step']}, trainer.total_steps is "
            f"{cfg.trainer.total_steps}; nothing to train (raise trainer.total_steps to train on)"
        )
        return None
    console.note(f"resuming from {path} (step {manifest['step']}, version {manifest['version']})")
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
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        pass_fds=(words.write_fd, *inherited_fds(spec)),
    )
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
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _die_with_parent() -> None:
    # SIGTERM, not SIGKILL: the role then stops its own children (vLLM's engine processes)
    # too; its orphan watchdog (runtime.role) kills its whole process group if it lingers.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
