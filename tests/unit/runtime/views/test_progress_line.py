"""The launcher's progress line fits the terminal: at 80 columns it keeps the bar, the step
count and the ETA (and the reward) and drops the less important fields; at 120 it shows every
field, among them each one the README says the line shows."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console as RichConsole

from runtime.config.load import load_config
from runtime.views.console import Console
from runtime.views.progress_line import ProgressLine, step_fields
from tests.conftest import ROOT

STEP = {"level": "info", "event": "step", "role": "controller", "rank": 0, "step": 12, "policy_version": 12,
        "reward_mean": 0.089, "response_len_mean": 30.73, "staleness_max": 1, "dropped_stale": 0,
        "samples_per_s": 115.7, "rollout_idle_ratio": 0.03, "trainer_idle_ratio": 0.03, "wall_s": 30.0}  # fmt: skip
# The README's words for what the line shows, and how the line writes each.
README_WORDS = {"reward": "reward 0.089", "response length": "len 30.7", "staleness": "stale≤1",
                "wall time": "wall ", "ETA": "eta "}  # fmt: skip


def rendered(width: int) -> str:
    """The line as the launcher's console draws it on a terminal `width` columns wide."""
    console = Console(Path("/nonexistent"), load_config("configs/tiny_cpu.yaml", []))  # 40 steps
    buf = io.StringIO()
    console.out = RichConsole(file=buf, width=width, force_terminal=True, color_system=None, highlight=False)
    console.show(STEP)
    console.finish()
    lines = [line for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "\n", buf.getvalue()).splitlines() if line.strip()]
    return lines[-1]


def test_at_80_columns_the_bar_step_count_eta_and_reward_stay() -> None:
    line = rendered(80)
    assert len(line) <= 80, line
    assert re.match(r"^━{10,} 12/40 ", line), line
    assert line.endswith(" eta ?") and "reward 0.089" in line and "len 30.7" in line
    assert "idle gen" not in line and "drop 0" not in line, "the least important fields go first"


def test_at_120_columns_every_field_is_there() -> None:
    line = rendered(120)
    assert len(line) <= 120, line
    assert re.match(r"^━{10,} 12/40 v12 reward 0.089 len 30.7 stale≤1 drop 0 115.7 samples/s idle gen 3% train 3% "
                    r"wall \S+ eta \?$", line), line  # fmt: skip


def test_the_readme_names_what_the_line_shows() -> None:
    said = re.search(r"a progress line per step \(([^)]*)\)", " ".join((ROOT / "README.md").read_text().split()))
    assert said is not None
    words = [w.strip() for w in said.group(1).split(",")]
    assert set(words) == set(README_WORDS), words
    line = rendered(120)
    for word in words:
        assert README_WORDS[word] in line, (word, line)


@pytest.mark.parametrize("width", [40, 60, 80, 100, 120, 200])
def test_the_line_never_wraps_and_keeps_its_count_and_eta(width: int) -> None:
    line = ProgressLine(7, 40, step_fields(STEP, "wall 1h02m03s"), "12m30s").render(width).plain
    assert len(line) <= width and " 7/40 " in line and line.endswith(" eta 12m30s")


def test_a_step_with_failed_groups_shows_them_and_who_failed_them() -> None:
    """A bad episode is counted under a named reason in the step line too."""
    from runtime.views.progress_line import plain_line

    rec = {**STEP, "dropped_error": 16, "dropped_error_env": 8, "dropped_error_agent": 0, "dropped_error_generation": 8}
    line = plain_line(12, 40, step_fields(rec, "wall 1s"), "?")
    assert " drop 0 error 16 (env 8, generation 8) " in line, line
    assert " drop 0 115.7" in plain_line(12, 40, step_fields(STEP, "wall 1s"), "?")
