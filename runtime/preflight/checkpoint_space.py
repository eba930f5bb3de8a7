"""Room for a checkpoint, checked before a run starts: a run that can never save is
refused at launch (one line, exit 2) rather than at its first save.

`checkpoint_bytes(cfg, shape)` is what one checkpoint of the run takes, from the memory
plan's model shape: the trained parameters in the trainer's dtype and AdamW's two float32
moments (torch.distributed.checkpoint shards), the same for a critic, and the HF export
(`checkpoint.export_hf`: the whole policy, or the adapter with LoRA) in `model.dtype`.
It is an estimate within about 10 % (the tiny model: 4.6 MB planned, 5.1 MB written).
`check_checkpoint_space(cfg, shape)` raises `ConfigError` when the file system of
`RUN_DIR/checkpoints` has less free than one checkpoint, for a run that may save one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from runtime.checkpoints.checkpoint import checkpoints_root
from runtime.config import RunConfig
from runtime.config.placement import role_counts
from runtime.errors import ConfigError
from runtime.memory.estimate import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_BYTES = 8  # two float32 moments per trained parameter


def checkpoint_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """Bytes one checkpoint of this run takes (see the module docstring)."""
    lora = cfg.trainer.lora
    trained = shape.lora_params(lora.rank, lora.target_modules) if lora.rank else shape.num_params
    master = DTYPE_BYTES[cfg.fsdp.param_dtype] + ADAM_BYTES
    total = trained * master
    if role_counts(cfg).get("critic", 0):
        total += shape.num_params * master
    if cfg.checkpoint.export_hf:
        total += trained * DTYPE_BYTES[cfg.model.dtype]
    return total


def saves_checkpoints(cfg: RunConfig) -> bool:
    """Whether this run may write a checkpoint (at the end, on a cadence, or when stopped)."""
    c = cfg.checkpoint
    return c.final or c.every > 0 or c.every_minutes > 0 or c.preempt_grace_s > 0


def check_checkpoint_space(cfg: RunConfig, shape: ModelShape) -> None:
    """ConfigError when one checkpoint does not fit the file system of the checkpoints."""
    if not saves_checkpoints(cfg):
        return
    root = checkpoints_root(cfg.run_dir)
    free = free_bytes(root)
    need = checkpoint_bytes(cfg, shape)
    if free < need:
        raise ConfigError(
            f"no room for a checkpoint: one takes about {_size(need)} and the file system of {root} has "
            f"{_size(free)} free; free some space, choose another run_dir=..., or set checkpoint.final=false, "
            "checkpoint.every=0, checkpoint.every_minutes=0 and checkpoint.preempt_grace_s=0 to save none"
        )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(path: Path) -> int:
    """Free bytes of the file system holding `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
