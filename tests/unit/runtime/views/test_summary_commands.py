"""The end summary's commands run as printed from the shell that launched the run: they name
`tandem` as it was started (`.venv/bin/tandem` when that is how, plain `tandem` when it is the
one on PATH); and its metrics show NaN / inf rather than leaving them out."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from runtime.views.summary import end_summary, program
from tests.conftest import ROOT

VENV_TANDEM = Path(sys.executable).parent / "tandem"


def test_a_run_started_by_the_venvs_path_prints_that_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [".venv/bin/tandem", "launch", "configs/tiny_cpu.yaml"])
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # not activated
    assert program() == ".venv/bin/tandem"


@pytest.mark.skipif(not VENV_TANDEM.exists(), reason="no tandem script beside this interpreter")
def test_a_run_started_from_an_activated_venv_prints_tandem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(VENV_TANDEM), "launch", "configs/tiny_cpu.yaml"])
    monkeypatch.setenv("PATH", f"{VENV_TANDEM.parent}{os.pathsep}/usr/bin")
    assert program() == "tandem"


def test_a_run_started_otherwise_prints_tandem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(ROOT / "runtime" / "cli.py"), "launch"])
    assert program() == "tandem"


def test_the_summary_uses_it_and_shows_non_finite_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/opt/tandem/.venv/bin/tandem", "launch", "x.yaml"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    record = {"step": 5, "reward_mean": "nan", "response_len_mean": None, "staleness_mean": 1.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    lines = end_summary(tmp_path, "wall 1m02s")
    assert lines[0] == "finished: wall 1m02s, step 5, reward_mean nan, response_len_mean nan, staleness_mean 1.000"
    assert f"  report         /opt/tandem/.venv/bin/tandem report {tmp_path}" in lines
