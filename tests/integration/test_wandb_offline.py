"""The wandb sink with real wandb in offline mode (a wandb service process): the run is
named after the run directory, carries project, group and the resolved config; a run
resumed from a checkpoint continues the same wandb run (the id stored in the run
directory), while a run starting at step 0 gets a new one."""

from __future__ import annotations

from pathlib import Path

import pytest

from roles.controller.metrics import REQUIRED_KEYS, MetricsSink
from roles.controller.wandb_run import stored_run_id
from runtime.checkpoints import checkpoint
from runtime.config import MetricsConfig
from runtime.config.load import load_config, to_yaml


def step(n: int) -> dict[str, float]:
    return {k: float(n) for k in REQUIRED_KEYS} | {"step": n}


def sink(run_dir: Path, cfg: MetricsConfig) -> MetricsSink:
    return MetricsSink(run_dir / "metrics.jsonl", cfg, run_dir, "ignored-name")


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv(checkpoint.RESUME_ENV, raising=False)
    run = tmp_path / "my-run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(None, ["trainer.total_steps=3"])))
    cfg = MetricsConfig(wandb=True, wandb_project="proj", wandb_group="g1")

    first = sink(run, cfg)
    run_id = first._wandb.id
    assert (first._wandb.project, first._wandb.group, first._wandb.name) == ("proj", "g1", "my-run")
    assert first._wandb.config["trainer"]["total_steps"] == 3
    first.write(step(1))
    first.close()
    assert stored_run_id(run) == run_id

    monkeypatch.setenv(checkpoint.RESUME_ENV, str(run / "checkpoints" / "step-00000001"))
    again = sink(run, cfg)
    assert again._wandb.id == run_id
    again.write(step(2))
    again.close()

    monkeypatch.delenv(checkpoint.RESUME_ENV)
    fresh = sink(run, cfg)  # step 0 again (a new run, or resume=fresh): a new wandb run
    assert fresh._wandb.id != run_id and stored_run_id(run) == fresh._wandb.id
    fresh.close()
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
