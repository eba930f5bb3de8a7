"""benchmarks/distill.py's variant selection: `--only` runs one variant and reports no ratio,
`--reuse` hands reuse to every variant, and each variant's start and end reach stderr.
The launches themselves are async_vs_sync.py's (tests/unit/benchmarks/test_async_vs_sync.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import benchmarks.distill as bench
from benchmarks.async_vs_sync import Policy

CONFIG = "configs/distill_tiny_cpu.yaml"


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Each variant the benchmark ran, as (run directory name, reuse), in order; every
    variant runs at 10 samples/s with the teacher at 9."""
    calls: list[tuple[str, bool]] = []

    def run_variant(config: Path, overrides: list[str], args: Any, policy: Policy, *, reuse: bool) -> dict[str, Any]:
        run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir="))
        calls.append((Path(run_dir).name, reuse))
        return {"samples_per_s": 9.0 if Path(run_dir).name == "teacher" else 10.0}

    monkeypatch.setattr(bench, "run_variant", run_variant)
    monkeypatch.setattr(bench, "setup_policy", lambda cfg, root: Policy(10**6, 10.0, []))
    monkeypatch.setattr(bench, "teacher_overrides", lambda cfg, root: ["algorithm.distill.teacher=/teacher"])
    monkeypatch.setattr(bench, "teacher_figures", lambda run_dir, warmup, measured: {"teacher_failures": 0.0})
    monkeypatch.setattr(bench, "check_launch", lambda cfg: None)
    return calls


def test_only_runs_one_variant_and_reports_no_ratio(
    ran: list[tuple[str, bool]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench.main(
        ["--config", CONFIG, "--only", "teacher", "--run-root", str(tmp_path), "--out", str(tmp_path / "o.json")]
    )
    assert ran == [("teacher", False)]
    result = json.loads((tmp_path / "o.json").read_text())
    assert list(result["variants"]) == ["teacher"]
    assert result["teacher_over_no_teacher"] is None and result["hidden"] is None
    assert result["variants"]["teacher"]["teacher_failures"] == 0.0
    err = capsys.readouterr().err
    assert "distill: teacher: starting" in err and "distill: teacher: 9.00 samples/s" in err


def test_reuse_reaches_both_variants_and_the_ratio_is_the_teachers_over_the_other(
    ran: list[tuple[str, bool]], tmp_path: Path
) -> None:
    bench.main(["--config", CONFIG, "--reuse", "--run-root", str(tmp_path), "--out", str(tmp_path / "o.json")])
    assert ran == [("no_teacher", True), ("teacher", True)]
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["teacher_over_no_teacher"] == pytest.approx(0.9) and result["hidden"] is True


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "student"])
