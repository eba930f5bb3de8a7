"""Paths inside a run directory (importable without torch)."""

from __future__ import annotations

from pathlib import Path

from runtime.config import RunConfig


def model_dir(cfg: RunConfig) -> Path:
    """The policy's HF directory: `model.path`, or the tiny model made inside the run dir."""
    return Path(cfg.model.path) if cfg.model.path else Path(cfg.run_dir) / "model"


def metrics_path(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) / "metrics.jsonl"


def checkpoints_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) / "checkpoints"
