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
from runtime.config.placement import role_counts

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
            "tp": m.tensor_model_parallel_size,
            "pp": m.pipeline_model_parallel_size,
            "world_size": counts.get("trainer", 0),
        }
    if cfg.critic.backend == "megatron" and counts.get("critic", 0):
        c = cfg.critic.megatron
        out["critic"] = {
            "tp": c.tensor_model_parallel_size,
            "pp": c.pipeline_model_parallel_size,
            "world_size": counts.get("critic", 0),
        }
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


# What makes a checkpoint part appear or not, for the one-line refusal of a resume.
PART_KEYS = {
    "adapter/": "trainer.lora.rank (the checkpoint has no LoRA adapter: it was saved without trainer.lora)",
    "hf/": "trainer.lora.rank or checkpoint.export_hf (the checkpoint has no full HF export: LoRA or export_hf=false)",
    "critic/": "algorithm.advantage / placement (the checkpoint has no critic: it was saved without one)",
    "actor/": "placement (the checkpoint has no actor shards)",
    "controller.json": "placement (the checkpoint has no controller state)",
}


def cannot_serve(checkpoint: Path, cfg: RunConfig) -> str:
    """One line: why the newest intact `checkpoint` cannot serve this run's config, naming
    the key that changed."""
    from runtime.checkpoints.checkpoint import read_manifest, required_parts

    files = read_manifest(checkpoint).get("files", {})
    for part in required_parts(cfg):
        present = any(rel.startswith(part) for rel in files) if part.endswith("/") else part in files
        if not present:
            name = part.rstrip("/")
            return f"checkpoint {checkpoint} cannot serve this config: no {name} part; see {PART_KEYS[part]}"
    return f"checkpoint {checkpoint} cannot serve this config"


def check_adapter_rank(checkpoint: Path, cfg: RunConfig) -> str:
    """ "" unless `checkpoint`'s LoRA adapter has another rank than trainer.lora.rank."""
    path = checkpoint / "adapter" / "adapter_config.json"
    if not cfg.trainer.lora.rank or not path.is_file():
        return ""
    saved = json.loads(path.read_text()).get("r")
    if saved in (None, cfg.trainer.lora.rank):
        return ""
    return f"checkpoint {checkpoint} holds a LoRA adapter of rank {saved}, trainer.lora.rank is {cfg.trainer.lora.rank}"
