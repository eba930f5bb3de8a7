"""The distillation teacher's launch checks: a tokenizer that differs from the policy's is
refused in one line naming the first differing token (exit 2, before any role starts), and
`algorithm.distill` is checked against the placement and the rollout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from runtime.config.load import load_config
from runtime.config.validate import check_distill
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch
from runtime.preflight.teacher import tokenizer_mismatch
from runtime.tiny.model import make_tiny_model
from tests.conftest import ROOT

CONFIG = "configs/distill_tiny_cpu.yaml"


def _swapped(src: Path, dst: Path) -> Path:
    """A copy of the tiny model whose tokenizer has ids 66 and 67 ('B' and 'C') swapped."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    vocab["B"], vocab["C"] = vocab["C"], vocab["B"]
    path.write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_same_tokenizer_passes(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert tokenizer_mismatch(tok, AutoTokenizer.from_pretrained(str(tiny))) == ""


def test_first_differing_token_is_named(tiny: Path, tmp_path: Path) -> None:
    other = AutoTokenizer.from_pretrained(str(_swapped(tiny, tmp_path / "teacher")))
    assert tokenizer_mismatch(AutoTokenizer.from_pretrained(str(tiny)), other) == (
        "token id 66: 'B' in the policy's, 'C' in the teacher's"
    )


def test_launch_refuses_a_teacher_of_another_tokenizer_in_one_line(tiny: Path, tmp_path: Path) -> None:
    teacher = _swapped(tiny, tmp_path / "teacher")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "runtime.cli", "launch", CONFIG, f"run_dir={run_dir}",
           f"model.path={tiny}", f"algorithm.distill.teacher={teacher}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert (
        "algorithm.distill.teacher" in lines[0] and "token id 66: 'B' in the policy's, 'C' in the teacher's" in lines[0]
    )
    assert not (run_dir / "logs").exists() or not any((run_dir / "logs").glob("teacher-*"))  # no role started


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("algorithm.distill.teacher=", "placement has a teacher but algorithm.distill.teacher is not set"),
        ("algorithm.distill.teacher=/nowhere", r"algorithm.distill.teacher '/nowhere' is not a directory"),
        ("algorithm.filter_groups=true", "algorithm.filter_groups drops groups of equal task reward"),
        ("algorithm.distill.engine.max_model_len=128", r"algorithm.distill.engine.max_model_len \(128\) is below"),
    ],
)
def test_distill_checks_at_config_time(override: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        check_launch(load_config(CONFIG, [override]))


def test_the_recipe_passes_the_checks() -> None:
    cfg = load_config(CONFIG, [])
    check_launch(cfg)
    check_distill(cfg, placed=1)
    check_launch(load_config(CONFIG, ["rollout.n=1"]))  # pure distillation needs no group baseline
    with pytest.raises(ConfigError, match=r"needs rollout\.n >= 2"):
        check_launch(load_config(CONFIG, ["rollout.n=1", "algorithm.distill.reward=add"]))
