"""A NaN or infinite metric is shown, never a crash and never a skipped step, by every reader:
the launcher's progress line (from the controller's JSON log, where msgspec writes NaN as
null), `tandem watch` and `tandem report` (from metrics.jsonl, where the writer may give
`NaN` / `Infinity`, null, or the text "nan" / "inf" / "-inf")."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console as RichConsole

from runtime.config.load import load_config
from runtime.views.console import Console
from runtime.views.records import metric, usable_metrics
from runtime.views.report.build import build_report, summary
from runtime.views.report.load import load_run
from runtime.views.watch import frame, sparkline
from runtime.views.watch_state import RunState
from tests.conftest import ROOT

RECORDED = ROOT / "tests" / "data" / "tiny_run"
# How a NaN / inf reward may reach a reader, and what it must show.
WRITTEN = [(None, "nan"), ("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), (math.nan, "nan"), (math.inf, "inf")]


@pytest.mark.parametrize(("value", "shown"), WRITTEN)
def test_a_metric_written_as_null_text_or_a_number_reads_back_as_a_float(value: Any, shown: str) -> None:
    rec = {"step": 3, "reward_mean": value, "kind": "validation"}
    assert usable_metrics(rec)
    assert f"{metric(rec, 'reward_mean'):.3f}" == shown
    assert metric(rec, "absent", 7.0) == 7.0 and metric({"n": 2}, "n") == 2
    assert not usable_metrics({"step": 3, "reward_mean": "high"})  # other text is still a damaged record


@pytest.mark.parametrize(("value", "shown"), WRITTEN)
@pytest.mark.parametrize("terminal", [False, True])
def test_the_progress_line_shows_a_non_finite_metric(tmp_path: Path, value: Any, shown: str, terminal: bool) -> None:
    console = Console(tmp_path, load_config("configs/tiny_cpu.yaml", []))
    buf = io.StringIO()
    console.out = RichConsole(file=buf, highlight=False, soft_wrap=True, width=160, force_terminal=terminal)
    for step in (1, 2):  # two steps: the ETA's pace is computed too
        metrics = {"reward_mean": value, "samples_per_s": value, "response_len_mean": value}
        rec = {"level": "info", "event": "step", "role": "controller", "rank": 0, "step": step, "wall_s": 1.0 * step}
        console.show(json.loads(json.dumps({**rec, **metrics})))  # as the console gets it: read back from the log
    console.finish()
    assert f"reward {shown}" in buf.getvalue() and f"len {shown}" in buf.getvalue()


def nan_run(tmp_path: Path, value: Any) -> Path:
    """The recorded run with its last step's reward and throughput written as `value`."""
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if "kind" not in json.loads(line))
    rec = json.loads(lines[last])
    rec.update(reward_mean=value, samples_per_s=value, staleness_mean=value, wall_s=value)
    lines[last] = json.dumps(rec)  # Python's json: NaN / Infinity as bare words, as json.dumps writes them
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize(("value", "shown"), WRITTEN)
def test_watch_shows_a_non_finite_metric_and_keeps_the_step(tmp_path: Path, value: Any, shown: str) -> None:
    state = RunState(nan_run(tmp_path, value))
    state.poll()
    assert state.num_skipped() == 0 and state.steps[-1]["step"] == 40
    buf = io.StringIO()
    RichConsole(file=buf, width=140).print(frame(state, live=False))
    assert re.search(rf"reward\s+{shown}  \(std", buf.getvalue()), buf.getvalue()
    assert re.search(rf"throughput\s+{shown} samples/s", buf.getvalue())
    assert sparkline([1.0, math.nan, 2.0, math.inf]) == "▁ █ "


@pytest.mark.parametrize(("value", "shown"), WRITTEN)
def test_the_report_shows_a_non_finite_metric_as_a_gap(tmp_path: Path, value: Any, shown: str) -> None:
    run = nan_run(tmp_path, value)
    data = load_run(run)
    assert not data.skipped and data.steps[-1]["step"] == 40
    steps, rewards = data.series("reward_mean")
    assert steps[-1] == 40 and f"{rewards[-1]:.3f}" == shown
    assert summary(data)["last reward"] == shown
    page = build_report(run, tmp_path / "r.html")
    assert "NaN" not in page.read_text().split("var FIGURES", 1)[1].split("</script>", 1)[0]  # JSON null: a gap
    done = subprocess.run([sys.executable, "-m", "runtime.cli", "report", str(run)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
