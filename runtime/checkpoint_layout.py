"""The parallel layout a Megatron checkpoint was saved with, checked before a resume.

A Megatron engine's checkpoint part (`actor/`, `critic/`) holds `megatron-layout.json`:
`{"tp": .., "pp": .., "world_size": ..}`. Its per-rank shards load only into the same
layout, so `check_resume_layout` compares it with what the run's config asks for and the
launcher refuses a mismatch in one line before any process starts (the engine checks
again, per rank, when it loads).
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.config import RunConfig
from runtime.placement import role_counts

LAYOUT_FILE = "megatron-layout.json"


def layout_mismatch(saved: dict[str, int], now: dict[str, int]) -> str:
    """ "" when equal, else one line naming both layouts."""
    if saved == now:
        return ""
    fmt = "TP={tp} PP={pp} world size {world_size}"
    return (
        f"saved with {fmt.format(**saved)}, this run has {fmt.format(**now)}; "
        "a Megatron checkpoint resumes only with the layout it was saved with"
    )


def configured_layouts(cfg: RunConfig) -> dict[str, dict[str, int]]:
    """Checkpoint part -> the layout this run's Megatron engines will have."""
    counts = role_counts(cfg)
    out = {}
    if cfg.trainer.backend == "megatron":
        m = cfg.trainer.megatron
        out["actor"] = {
            "tp": m.tensor_model_parallel_size, "pp": m.pipeline_model_parallel_size,
            "world_size": counts.get("trainer", 0),
        }  # fmt: skip
    if cfg.critic.backend == "megatron" and counts.get("critic", 0):
        c = cfg.critic.megatron
        out["critic"] = {
            "tp": c.tensor_model_parallel_size, "pp": c.pipeline_model_parallel_size,
            "world_size": counts.get("critic", 0),
        }  # fmt: skip
    return out


def check_resume_layout(checkpoint: Path, cfg: RunConfig) -> None:
    """ValueError (one line, naming the part) when a Megatron part of `checkpoint` was saved
    with another layout than this run's, or was not saved by a Megatron engine."""
    for part, want in configured_layouts(cfg).items():
        path = checkpoint / part / LAYOUT_FILE
        if not path.is_file():
            raise ValueError(
                f"resume: {checkpoint / part} has no {LAYOUT_FILE} (not saved by a Megatron engine); "
                f"its backend must match the run's"
            )
        problem = layout_mismatch(json.loads(path.read_text()), want)
        if problem:
            raise ValueError(f"resume: {checkpoint / part} {problem}")
