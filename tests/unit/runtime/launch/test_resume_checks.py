"""`resume=auto` refuses, before anything starts, a checkpoint that cannot serve the config,
and a finished run ends at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.checkpoints.base_model import identity
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.launch.launcher import _resume_from
from runtime.tiny.model import make_tiny_model
from runtime.views.console import Console
from tests.conftest import ROOT
from tests.unit.runtime.test_run_dir import fake_checkpoint

FULL = ["controller.json", "actor/x", "hf/model.safetensors"]


def resume(run: Path, *overrides: str) -> str | None:
    cfg = load_config("configs/tiny_cpu.yaml", [f"run_dir={run}", "resume=auto", *overrides])
    return _resume_from(cfg, Console(run, cfg, quiet=True))


def test_a_config_the_checkpoint_cannot_serve_is_refused_naming_the_key(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 20, FULL)
    refused = r"no adapter part; see trainer\.lora\.rank .*; or start over with resume=fresh"
    with pytest.raises(ConfigError, match=refused):
        resume(tmp_path, "trainer.lora.rank=8", "trainer.total_steps=40")
    assert resume(tmp_path, "trainer.total_steps=40") == str((tmp_path / "checkpoints/step-00000020").resolve())


def test_another_lora_rank_is_refused(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 20, ["controller.json", "actor/x", "adapter/adapter_model.safetensors"])
    (path / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ConfigError, match=r"adapter of rank 4, trainer\.lora\.rank is 8"):
        resume(tmp_path, "trainer.lora.rank=8", "trainer.total_steps=40")


def test_a_changed_tiny_model_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    base = make_tiny_model(tmp_path / "model", seed=0)
    before = identity(base)
    fake_checkpoint(tmp_path, 20, FULL, before)
    refused = r"trained on base model .* but the run's model is now .*as model\.tiny makes"
    with pytest.raises(ConfigError, match=refused):
        resume(tmp_path, "model.tiny.seed=1", "trainer.total_steps=40")
    assert identity(base) == before  # the check built the other model elsewhere
    assert resume(tmp_path, "trainer.total_steps=40")  # the same arguments: the same model


def test_a_finished_run_says_so_and_exits_0_at_once(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 20, FULL)
    started = time.monotonic()
    cmd = [sys.executable, "-m", "runtime.cli", "launch", "configs/tiny_cpu.yaml", f"run_dir={tmp_path}",
           "resume=auto", "trainer.total_steps=10"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the run is finished" in out.stdout and "trainer.total_steps is 10" in out.stdout, out.stdout
    assert not (tmp_path / "logs").exists()  # nothing was started
    assert time.monotonic() - started < 20
