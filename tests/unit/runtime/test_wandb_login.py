"""`metrics.wandb=true` without a login used to be found by the controller ~24 s into the
run, after vLLM started, as a cut traceback: `wandb_login_problem` finds it at launch.
Each case runs in a fresh interpreter (wandb keeps its settings in a process singleton)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("wandb")
ASK = "from runtime.preflight.wandb_login import wandb_login_problem; print(wandb_login_problem())"


def _problem(home: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    out = subprocess.run(
        [sys.executable, "-c", ASK],
        cwd=ROOT,
        env={**clean, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_no_key_anywhere_is_one_line_saying_how_to_log_in(tmp_path: Path) -> None:
    line = _problem(tmp_path)
    assert line.startswith("metrics.wandb=true but wandb has no API key for ")
    assert "wandb login" in line and "WANDB_MODE=offline" in line


def test_offline_or_a_key_is_no_problem(tmp_path: Path) -> None:
    assert _problem(tmp_path, WANDB_MODE="offline") == "None"
    assert _problem(tmp_path, WANDB_API_KEY="k" * 40) == "None"


def test_the_netrc_that_wandb_login_writes_is_a_login(tmp_path: Path) -> None:
    host = _problem(tmp_path).split(" for ")[1].split(":")[1].strip("/")  # the host wandb would ask
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    assert _problem(tmp_path) == "None"
