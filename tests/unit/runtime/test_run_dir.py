"""A run directory belongs to one run: a lock while a launch runs, no
launch into an earlier run's directory without `resume`, and the base model a checkpoint
was trained on recorded in its manifest and checked by resume and export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.checkpoints import checkpoint
from runtime.checkpoints.base_model import MANIFEST_KEY, identity
from runtime.checkpoints.export import export_checkpoint
from runtime.config.load import load_config, to_yaml
from runtime.errors import ConfigError
from runtime.identity.run_dir import check_run_dir, lock_run_dir, release_run_dirs
from runtime.tiny.model import make_tiny_model
from tests.conftest import ROOT

HOLD = "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "


def test_a_second_launch_is_refused_naming_the_holder_and_a_dead_holder_leaves_no_lock(tmp_path: Path) -> None:
    lock_run_dir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"in use by a running launch \(pid {os.getpid()}\)"):
            lock_run_dir(tmp_path)
    finally:
        release_run_dirs()
    # A holder that dies without cleaning up (SIGKILL) leaves the file, not the lock.
    holder = subprocess.Popen([sys.executable, "-c", HOLD + "print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "launch.lock")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with pytest.raises(ConfigError, match="in use by a running launch"):
        lock_run_dir(tmp_path)
    holder.kill()
    holder.wait()
    lock_run_dir(tmp_path)
    release_run_dirs()


def test_a_cli_launch_into_a_locked_run_dir_exits_2_in_one_line(tmp_path: Path) -> None:
    lock_run_dir(tmp_path)
    try:
        cmd = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", f"run_dir={tmp_path}"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        release_run_dirs()
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "in use by a running launch (pid" in out.stderr
    assert not (tmp_path / "logs").exists()


def earlier(run_dir: Path) -> None:
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "schedule.jsonl").write_text("{}\n")
    (run_dir / "config.yaml").write_text("name: old\n")


def test_an_earlier_run_is_refused_without_resume(tmp_path: Path) -> None:
    earlier(tmp_path)
    with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics.jsonl\): continue it"):
        check_run_dir(load_config("configs/tiny_cpu.yaml", [f"run_dir={tmp_path}"]))
    assert check_run_dir(load_config("configs/tiny_cpu.yaml", [f"run_dir={tmp_path}", "resume=auto"])) == []
    ckpt_only = tmp_path / "ckpt"
    (ckpt_only / "checkpoints" / "step-00000005").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"\(checkpoints/\)"):
        check_run_dir(load_config("configs/tiny_cpu.yaml", [f"run_dir={ckpt_only}"]))
    empty = tmp_path / "new"
    (empty / "model").mkdir(parents=True)  # a tiny model or keys alone are no earlier run
    assert check_run_dir(load_config("configs/tiny_cpu.yaml", [f"run_dir={empty}"])) == []


def test_a_launch_that_crashed_before_its_first_step_is_an_earlier_run(tmp_path: Path) -> None:
    """Its logs and config.yaml used to be overwritten and appended to in silence: node 0's
    launcher log marks it."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "launcher-0.jsonl").write_text('{"event": "launching"}\n')
    with pytest.raises(ConfigError, match=r"holds an earlier run \(logs/launcher-0.jsonl\)"):
        check_run_dir(load_config("configs/tiny_cpu.yaml", [f"run_dir={tmp_path}"]))


def test_other_nodes_writing_the_shared_directory_are_no_earlier_run(tmp_path: Path) -> None:
    """A multi-node launch: nodes 1 and 2 write config.yaml and their own launcher logs into
    the shared run directory while node 0 is still checking it (the three-host test raced)."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "launcher-1.jsonl").write_text('{"event": "launching"}\n')
    (tmp_path / "logs" / "rollout-1.out").write_text("starting\n")
    (tmp_path / "config.yaml").write_text("name: this run\n")
    assert check_run_dir(load_config("configs/tiny_cpu.yaml", [f"run_dir={tmp_path}"])) == []


def test_a_released_lock_with_remove_leaves_no_file(tmp_path: Path) -> None:
    lock_run_dir(tmp_path)
    release_run_dirs(remove=True)
    assert not (tmp_path / "launch.lock").exists()
    lock_run_dir(tmp_path)  # a new launch takes a new lock
    release_run_dirs(remove=True)


def test_resume_fresh_moves_the_earlier_run_aside_and_says_so(tmp_path: Path) -> None:
    earlier(tmp_path)
    (tmp_path / "model").mkdir()
    moved = check_run_dir(load_config("configs/tiny_cpu.yaml", [f"run_dir={tmp_path}", "resume=fresh"]))
    (dest,) = (tmp_path / "earlier").iterdir()
    assert sorted(p.name for p in dest.iterdir()) == ["config.yaml", "logs", "metrics.jsonl", "schedule.jsonl"]
    assert len(moved) == 4 and all(" -> " in line for line in moved)
    assert (tmp_path / "model").is_dir() and not (tmp_path / "metrics.jsonl").exists()


def fake_checkpoint(run_dir: Path, step: int, parts: list[str], base: dict[str, str] | None = None) -> Path:
    tmp = checkpoint.begin(run_dir, step)
    for rel in parts:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(b"x" * 8)
    meta: dict[str, object] = {"version": step}
    if base is not None:
        meta[MANIFEST_KEY] = base
    return checkpoint.commit(tmp, step, meta)


def test_identity_tells_two_random_models_of_one_shape_apart(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=0)
    b = make_tiny_model(tmp_path / "b", seed=1)
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert identity(a)["digest"] != identity(b)["digest"]
    assert identity(a)["digest"] == identity(again)["digest"]  # the same model elsewhere is the same model


def test_export_refuses_a_base_that_is_not_the_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run}", "trainer.lora.rank=8"])
    make_tiny_model(run / "model", seed=0)
    (run / "config.yaml").write_text(to_yaml(cfg))  # as the launcher writes it
    trained_on = identity(run / "model")
    fake_checkpoint(run, 20, ["controller.json", "actor/x", "adapter/adapter_config.json"], trained_on)
    make_tiny_model(run / "model", seed=1)  # a second launch replaced the base
    with pytest.raises(ValueError, match=rf"trained on base model .*digest {trained_on['digest']}.*now .*digest"):
        export_checkpoint(run, None, tmp_path / "out", merge=True)


def test_export_of_a_missing_step_lists_the_steps_there(tmp_path: Path) -> None:
    for step in (10, 15, 20):
        fake_checkpoint(tmp_path, step, ["controller.json"])
    with pytest.raises(FileNotFoundError, match=r"no intact checkpoint for step 5 .*\(steps there: 10, 15, 20\)"):
        export_checkpoint(tmp_path, 5, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"is not a directory"):
        export_checkpoint(tmp_path / "none", None, tmp_path / "out")


def test_manifest_records_the_base_model(tmp_path: Path) -> None:
    base = {"path": "/m", "digest": "abc"}
    path = fake_checkpoint(tmp_path, 3, ["controller.json"], base)
    assert json.loads((path / "manifest.json").read_text())[MANIFEST_KEY] == base


def test_resume_auto_without_a_checkpoint_sets_the_earlier_run_aside(tmp_path: Path) -> None:
    """It once printed "starting fresh" and appended to the old metrics.jsonl (steps
    1..100 twice, a report of "300/300"); now the earlier run goes where resume=fresh puts it."""
    from runtime.launch.launcher import _resume_from
    from runtime.views.console import Console

    earlier(tmp_path)
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={tmp_path}", "resume=auto"])
    assert check_run_dir(cfg) == []  # resume=auto is never refused for an earlier run
    assert _resume_from(cfg, Console(tmp_path, cfg, quiet=True), set_aside_earlier=True) == ""
    (dest,) = (tmp_path / "earlier").iterdir()
    assert sorted(p.name for p in dest.iterdir()) == ["config.yaml", "logs", "metrics.jsonl", "schedule.jsonl"]
    assert not (tmp_path / "metrics.jsonl").exists()
