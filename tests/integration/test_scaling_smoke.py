"""benchmarks/scaling.py end to end at the tiny CPU scale: real sync and async tiny runs on
heavy-tailed budgets (the schedule log shows every group generated exactly its budget:
`rollout.length_dist` reaches vLLM's max_tokens), the JSON figures per point, the report
page and its PNG; and a point the memory plan refuses is recorded, not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roles.controller.budgets import lognormal_max_tokens
from runtime.config.load import load_config
from runtime.views.report.browser import find_chromium
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _scaling(tmp_path: Path, *argv: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--points", "tiny", "--run-root",
           str(tmp_path / "runs"), "--out", str(tmp_path / "out.json"), *argv]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "out.json").read_text())
    return result


@pytest.mark.timeout(1600)
def test_length_axis_runs_sync_and_async_on_the_budgets(tmp_path: Path) -> None:
    result = _scaling(tmp_path, "--axis", "length", "--only", "mean-8", "--steps", "2", "--warmup-steps", "1",
                      "--staleness", "1", "--plot", str(tmp_path / "plot"), "checkpoint.final=false",
                      "--gpus", "7")  # fmt: skip
    (point,) = result["points"]
    assert point["point"] == "mean-8" and point["refused"] is None and point["x"] == 8
    # --gpus: the point's launches saw only "GPU 7" (on this CPU machine, an environment value and nothing more)
    assert point["gpu"] == "7" and result["gpus"] == ["7"]
    for variant in ("sync", "async"):
        launcher_log = Path(result["run_root"]) / "mean-8" / variant / "logs" / "launcher-0.jsonl"
        launching = next(r for r in map(json.loads, launcher_log.read_text().splitlines()) if r["event"] == "launching")
        assert launching["cuda_visible_devices"] == "7"
    for variant in ("sync", "async"):
        assert point[f"{variant}_samples_per_s"] > 0 and point[f"{variant}_trainer_mfu"] > 0
        assert point[f"{variant}_weight_sync_s"] > 0
    assert point["speedup"] > 0 and point["speedup_tokens"] > 0
    assert 0 <= point["async_dropped_stale_fraction"] < 1
    assert point["variants"]["sync"]["staleness_max"] == 0
    # Every group of every run generated n samples of exactly its budget (ignore_eos).
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", point["overrides"])
    dist, cap = cfg.rollout.length_dist, cfg.rollout.max_tokens
    assert (dist.kind, dist.mean_tokens, cap) == ("lognormal", 8, 32)
    for variant in ("sync", "async"):
        sched = Path(result["run_root"]) / "mean-8" / variant / "schedule.jsonl"
        sampled = [r for r in map(json.loads, sched.read_text().splitlines()) if r["ev"] == "sampled" and r["g"] >= 0]
        assert len(sampled) >= 16  # 2 steps x 8 prompts
        budgets = [lognormal_max_tokens(r["g"], cfg.seed, dist, cap) for r in sampled]
        assert [r["tok"] for r in sampled] == [cfg.rollout.n * b for b in budgets]
        assert len(set(budgets)) > 3  # a mix of lengths, not one
    page = tmp_path / "plot" / "scaling_length.html"
    assert result["plot"]["html"] == str(page) and page.stat().st_size > 10_000
    if find_chromium() is not None:
        png = Path(result["plot"]["png"])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_a_point_the_memory_plan_refuses_is_recorded_not_run(tmp_path: Path) -> None:
    result = _scaling(tmp_path, "--axis", "model", "memory.host_gb=0.2")
    assert [p["point"] for p in result["points"]] == ["tiny-128", "tiny-256"]
    for p in result["points"]:
        assert p["refused"].startswith("memory plan: host memory of node 0: needs ")
        assert p["variants"] == {}
    assert not (tmp_path / "runs" / "tiny-128").exists()  # nothing was started
