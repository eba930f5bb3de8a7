"""`tandem export RUN_DIR [--step N] OUT_DIR`: a checkpoint's policy as an HF directory.

Copies the checkpoint's `hf/` export when it has one; otherwise consolidates the sharded
actor state (torch.distributed.checkpoint) into the initial model's architecture and
saves that. Only intact checkpoints are exported (see runtime.checkpoint.validate).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from runtime import checkpoint
from runtime.config_load import load_config
from runtime.paths import model_dir


def export_checkpoint(run_dir: str | Path, step: int | None, out_dir: str | Path) -> Path:
    found = checkpoint.find_latest(run_dir, step)
    if found is None:
        which = f"step {step}" if step is not None else "any step"
        raise FileNotFoundError(f"no intact checkpoint for {which} under {checkpoint.checkpoints_root(run_dir)}")
    path, _ = found
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} is not empty")
    if (path / "hf").is_dir():
        shutil.copytree(path / "hf", out, dirs_exist_ok=True)
        return out
    return consolidate(path / "actor", model_dir(load_config(Path(run_dir) / "config.yaml")), out)


def consolidate(actor_dir: Path, source_model: Path, out: Path) -> Path:
    """Sharded actor checkpoint → HF directory, on CPU, without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(actor_dir), str(flat))
        state = torch.load(flat, weights_only=False)["model"]
    model = AutoModelForCausalLM.from_pretrained(str(source_model))
    model.load_state_dict(state, strict=False)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source_model / name).exists():
            shutil.copy2(source_model / name, out / name)
    return out
