"""The report builder on a recorded tiny run (tests/data/tiny_run: 40 async steps with
validation every 10, recorded by `tandem launch configs/tiny_cpu.yaml`): every panel has
data, the timeline has every kind of span, the schedule says which step trained each group,
and a run cut off mid-write (crashed, or still going) or without a schedule still reports."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs

from runtime.cli import main
from runtime.views.report.build import build_report, summary
from runtime.views.report.load import current_schedule, load_run
from runtime.views.report.panels import PANELS
from runtime.views.report.timeline import build_timeline, group_staleness, trained_at
from tests.conftest import ROOT

RECORDED = ROOT / "tests" / "data" / "tiny_run"


def figures(page: Path) -> dict[str, dict]:
    """The figures the page draws, by div id (read back from its script)."""
    text = page.read_text()
    data = re.search(r"var FIGURES = (\{.*?\});\n\(function", text, re.S)
    assert data is not None
    return {f"p-{k}": v for k, v in json.loads(data.group(1).replace("<\\/", "</")).items()}


def test_every_panel_of_the_recorded_run_has_data(tmp_path: Path) -> None:
    page = build_report(RECORDED, tmp_path / "r.html")
    figs = figures(page)
    assert set(figs) == {"p-timeline-0", *(f"p-{p}" for p in PANELS)}
    for div, fig in figs.items():
        assert f'id="{div}"' in page.read_text()
        points = sum(len(t.get("x") or []) for t in fig["data"])
        if div == "p-kl":  # the recorded run has no KL penalty: no other metric stands in
            assert fig["data"] == [] and "penalty is off" in fig["layout"]["annotations"][0]["text"]
            continue
        assert points > 0, f"{div} draws nothing"
    reward = {t["name"]: t for t in figs["p-reward"]["data"]}
    assert len(reward["reward"]["x"]) == 40 and reward["validation"]["x"] == [0, 10, 20, 30, 40]
    own = page.read_text().replace(get_plotlyjs(), "")
    assert "plotly.js v" in get_plotlyjs() and get_plotlyjs() in page.read_text(), "plotly.js is inlined"
    assert "src=" not in own and "<link" not in own, "the page loads nothing: it opens offline"


def test_the_timeline_has_generation_training_syncs_and_validation() -> None:
    run = load_run(RECORDED)
    tl = build_timeline(run.schedule)
    kinds = {s.kind for s in tl.spans}
    assert {"generation", "validation_generation", "train", "sync", "weights", "validation"} <= kinds
    assert "in_flight" not in kinds, "a finished run has nothing in flight"
    for lane in {s.row for s in tl.spans if s.kind == "generation"}:
        spans = sorted((s for s in tl.spans if s.row == lane), key=lambda s: s.start)
        assert all(a.end <= b.start for a, b in itertools.pairwise(spans)), lane
    train = sorted((s for s in tl.spans if s.kind == "train"), key=lambda s: s.start)
    assert [s.version for s in train] == list(range(40)), "step N trains version N - 1"
    assert set(tl.rows) >= {"trainer", "step phases", "rollout-0 weights", "validation", "rollout-0 · 0",
                            "rollout-0 val · 0"}  # fmt: skip
    assert {"phase_train", "phase_push", "glue"} <= kinds and summary(run)["step glue (median)"].endswith("s")
    assert len([r for r in tl.rows if r.startswith("rollout-0 · ")]) <= 128 // 8, "at most max_num_seqs / n at once"
    assert min(s.start for s in tl.spans) >= 0 and max(s.end for s in tl.spans) <= tl.end + 1e-6


def test_the_schedule_says_which_step_trained_every_group_and_agrees_with_the_metrics() -> None:
    run = load_run(RECORDED)
    steps = trained_at(run.schedule)
    admitted = {r["g"] for r in run.schedule if r["ev"] == "admit"}
    dropped = {r["g"] for r in run.schedule if r["ev"] == "drop"}
    assert set(steps) | dropped == admitted and not set(steps) & dropped
    per_step = [sum(1 for s in steps.values() if s == m["step"]) for m in run.steps]
    samples = [round(m["samples_per_s"] * m["step_s"]) for m in run.steps]
    assert samples == [8 * n for n in per_step] == [64] * 40  # 8 groups of 8 samples per step
    staleness = group_staleness(run.schedule)
    assert len(staleness) == 320 and max(staleness) == max(m["staleness_max"] for m in run.steps) == 1
    assert summary(run)["status"] == "finished" and summary(run)["groups trained"] == 320


def test_a_run_cut_off_mid_write_reports_what_it_has(tmp_path: Path) -> None:
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(RECORDED / "config.yaml", cut)
    for name in ("metrics.jsonl", "schedule.jsonl"):
        text = (RECORDED / name).read_text()
        (cut / name).write_text(text[: len(text) // 2])  # ends inside a line
    run = load_run(cut)
    assert 0 < len(run.steps) < 40 and summary(run)["status"].startswith("incomplete")
    tl = build_timeline(run.schedule)
    assert any(s.kind == "in_flight" for s in tl.spans), "groups sent and not back are drawn as in flight"
    page = build_report(cut)
    assert page == cut / "report.html" and all(figures(page)[f"p-{p}"]["data"] for p in PANELS if p != "kl")


def test_compare_overlays_both_runs_and_a_run_without_schedule_still_reports(tmp_path: Path) -> None:
    other = tmp_path / "sync_run"
    other.mkdir()
    shutil.copy(RECORDED / "metrics.jsonl", other)  # no schedule.jsonl (metrics.schedule: false)
    page = build_report(RECORDED, tmp_path / "c.html", compare=other)
    figs = figures(page)
    assert {"p-timeline-0", "p-timeline-1"} <= set(figs)
    names = [t["name"] for t in figs["p-reward"]["data"]]
    assert "reward (tiny_run)" in names and "reward (sync_run)" in names
    assert "no schedule.jsonl" in figs["p-timeline-1"]["layout"]["title"]["text"]


def test_the_cli_writes_the_report_and_refuses_a_directory_that_is_no_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as done:
        main(["report", str(RECORDED), "-o", str(tmp_path / "cli.html")])
    assert done.value.code == 0 and (tmp_path / "cli.html").stat().st_size > 1_000_000  # plotly.js inlined
    with pytest.raises(SystemExit) as refused:
        main(["report", str(tmp_path / "nothing")])
    assert refused.value.code == 2


def test_validation_groups_a_round_gave_up_on_are_not_drawn_as_in_flight() -> None:
    schedule = [
        {"ev": "run", "step": 0, "version": 0, "t": 0.0},
        {"ev": "dispatch", "g": -1, "to": "rollout-0", "try": 1, "t": 1.0},
        {"ev": "dispatch", "g": -2, "to": "rollout-0", "try": 1, "t": 1.0},
        {"ev": "dispatch", "g": 0, "to": "rollout-0", "try": 1, "t": 1.5},
        {"ev": "sampled", "g": -1, "to": "rollout-0", "t0": 1.0, "vmin": 0, "vmax": 0, "tok": 3, "t": 2.0},
        {"ev": "val", "step": 0, "version": 0, "t0": 1.0, "groups": 2, "t": 3.0},  # timed out: -2 never came
    ]
    tl = build_timeline(schedule)
    drawn = {(s.kind, s.text.split(" ·")[0]) for s in tl.spans if "generation" in s.kind or s.kind == "in_flight"}
    assert drawn == {("validation_generation", "validation group"), ("in_flight", "group 0 in flight")}


def test_a_resumed_run_counts_what_it_did_again_once() -> None:
    """Crashed after step 2 with group 4 in flight, resumed from step 1's checkpoint (next group 2)."""
    first = [{"ev": "run", "step": 0, "version": 0, "next_g": 0, "t": 0.0}]
    first += [{"ev": "admit", "g": g, "v": 0, "uid": g, "t": 0.1} for g in range(5)]
    first += [{"ev": "dispatch", "g": 4, "to": "rollout-0", "try": 1, "t": 0.2}]
    first += [{"ev": "step", "step": 1, "version": 1, "t0": 1.0, "groups": [0, 1], "t": 2.0},
              {"ev": "step", "step": 2, "version": 2, "t0": 2.0, "groups": [2, 3], "t": 3.0}]  # fmt: skip
    again = [{"ev": "run", "step": 1, "version": 1, "next_g": 2, "t": 10.0}]
    again += [{"ev": "admit", "g": g, "v": 1, "uid": g + 10, "t": 10.1} for g in (2, 3)]
    again += [{"ev": "step", "step": 2, "version": 2, "t0": 11.0, "groups": [2, 3], "t": 12.0}]
    kept = current_schedule(first + again)
    assert trained_at(kept) == {0: 1, 1: 1, 2: 2, 3: 2}
    assert [r["t"] for r in kept if r["ev"] == "step"] == [2.0, 12.0]
    assert {r["g"] for r in kept if r["ev"] == "admit"} == {0, 1, 2, 3} and not any(r.get("g") == 4 for r in kept)
    assert not any(s.kind == "in_flight" for s in build_timeline(first + again).spans)


def corrupt_copy(tmp_path: Path) -> Path:
    """The recorded run with type-corrupted, truncated and binary lines in both files."""
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(RECORDED / "config.yaml", bad)
    metrics = (RECORDED / "metrics.jsonl").read_text().splitlines(keepends=True)
    step = json.loads(metrics[5])
    metrics[5] = json.dumps({**step, "reward_mean": "high"}) + "\n"
    metrics.insert(7, '{"step": 3, "reward_me\n')
    (bad / "metrics.jsonl").write_bytes("".join(metrics).encode() + b"\x00\xff\xfe binary\n")
    schedule = (RECORDED / "schedule.jsonl").read_text().splitlines(keepends=True)
    first_sampled = next(i for i, line in enumerate(schedule) if '"sampled"' in line)
    schedule[first_sampled] = json.dumps({**json.loads(schedule[first_sampled]), "t0": "yesterday"}) + "\n"
    schedule.append(json.dumps({"ev": "step", "step": "x", "version": 1, "t0": 1, "t": 2, "groups": [1]}) + "\n")
    (bad / "schedule.jsonl").write_text("".join(schedule))
    return bad


def test_type_corrupted_truncated_and_binary_lines_are_skipped_with_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = corrupt_copy(tmp_path)
    run = load_run(bad)
    assert run.skipped == {"metrics.jsonl": 3, "schedule.jsonl": 2}
    assert len(run.steps) == 39  # the corrupted step is left out, the rest are read
    with pytest.raises(SystemExit) as done:
        main(["report", str(bad), "-o", str(tmp_path / "bad.html")])
    assert done.value.code == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: warning: skipped 5 line(s) of ")
