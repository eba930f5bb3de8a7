"""Paths inside a run directory (importable without torch): the one place their names are spelled."""

from __future__ import annotations

from pathlib import Path

from runtime.config import RunConfig

METRICS = "metrics.jsonl"  # one JSON record per training step
SCHEDULE = "schedule.jsonl"  # the controller's schedule log
SCHEDULE_ROTATED = "schedule.1.jsonl"  # its older part, once it passed its size cap
CHECKPOINTS = "checkpoints"  # step-N/ directories


def model_dir(cfg: RunConfig) -> Path:
    """The policy's HF directory: `model.path`, or the tiny model made inside the run dir."""
    return Path(cfg.model.path) if cfg.model.path else Path(cfg.run_dir) / "model"


def reward_model_dir(cfg: RunConfig) -> Path:
    """The reward model's HF directory: `reward.model.path`, or the tiny classifier made
    inside the run dir when it is `tiny`."""
    path = cfg.reward.model.path
    return Path(cfg.run_dir) / "reward_model" if path == "tiny" else Path(path)


def teacher_dir(cfg: RunConfig) -> Path:
    """The distillation teacher's HF directory: `algorithm.distill.teacher`, or the tiny
    teacher made inside the run dir when it is `tiny`."""
    path = cfg.algorithm.distill.teacher
    return Path(cfg.run_dir) / "teacher" if path == "tiny" else Path(path)


def metrics_path(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) / METRICS
