"""`tandem export RUN_DIR [--step N] [--merge] OUT_DIR`: a checkpoint's policy as an HF directory.

Copies the checkpoint's `hf/` export when it has one; otherwise consolidates the sharded
actor state (torch.distributed.checkpoint) into the initial model's architecture and
saves that. A LoRA run's checkpoint holds `adapter/` instead: it is copied as it is (a
PEFT adapter directory, for `PeftModel.from_pretrained` or vLLM's `LoRARequest`), or with
`merge` folded into the run's base model (PEFT's `merge_and_unload`: W + alpha/r * B @ A)
and saved as a plain HF model directory. Only intact checkpoints are exported (see
runtime.checkpoints.checkpoint.validate).

What a caller may rely on: the exported files get the modes of files made by this process
(0644 under the usual umask 022), not the 0600 that safetensors writes; an exported adapter's
`adapter_config.json` names its base model (`base_model_name_or_path`: the absolute path of
the model the checkpoint was trained on), as PEFT's own `save_pretrained` does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from runtime.checkpoints import checkpoint
from runtime.checkpoints.base_model import MANIFEST_KEY, mismatch
from runtime.config.load import load_config
from runtime.hf_quiet import no_progress_bars
from runtime.identity.paths import model_dir


def export_checkpoint(run_dir: str | Path, step: int | None, out_dir: str | Path, *, merge: bool = False) -> Path:
    """Write the policy of checkpoint `step` (default: the newest intact one) to `out_dir`
    (absent or empty); returns `out_dir`. FileNotFoundError: no such checkpoint (the message
    lists the steps there) or `run_dir` is not a directory; ValueError: `out_dir` is not
    empty, `merge` on a full checkpoint, or the run's base model is not the checkpoint's."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory")
    out = Path(out_dir)
    made = not out.exists()  # a folder the user made keeps its mode
    _export(run_dir, step, out, merge=merge)
    normal_modes(out, root_too=made)
    return out


def _export(run_dir: str | Path, step: int | None, out: Path, *, merge: bool) -> Path:
    found = checkpoint.find_latest(run_dir, step)
    if found is None:
        raise FileNotFoundError(_not_found(run_dir, step))
    path, manifest = found
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} is not empty")
    if (path / "adapter").is_dir():
        if not merge:
            shutil.copytree(path / "adapter", out, dirs_exist_ok=True)
            name_base(out / "adapter_config.json", _base_name(run_dir, manifest))
            return out
        return merge_adapter(path / "adapter", _base(run_dir, path, manifest), out)
    if merge:
        raise ValueError(f"--merge: {path} is not a LoRA checkpoint (no adapter/); export it without --merge")
    if (path / "hf").is_dir():
        shutil.copytree(path / "hf", out, dirs_exist_ok=True)
        return out
    return consolidate(path / "actor", _base(run_dir, path, manifest), out)


def _not_found(run_dir: str | Path, step: int | None) -> str:
    root = checkpoint.checkpoints_root(run_dir)
    which = f"step {step}" if step is not None else "any step"
    there = checkpoint.steps(run_dir)
    listed = f"steps there: {', '.join(map(str, there))}" if there else "it holds no checkpoint"
    return f"no intact checkpoint for {which} under {root} ({listed})"


def _base(run_dir: str | Path, path: Path, manifest: dict[str, Any]) -> Path:
    """The run's base model, refused (ValueError naming both) when it is not the one the
    checkpoint was trained on."""
    base = model_dir(load_config(Path(run_dir) / "config.yaml"))
    problem = mismatch(path, manifest, base)
    if problem:
        raise ValueError(f"{problem}; export needs the base model the checkpoint was trained on")
    return base


def _base_name(run_dir: str | Path, manifest: dict[str, Any]) -> str:
    """The base model as recorded in the checkpoint, else (an older checkpoint) the run's."""
    recorded = manifest.get(MANIFEST_KEY) or {}
    return recorded.get("path") or str(model_dir(load_config(Path(run_dir) / "config.yaml")).resolve())


def name_base(adapter_config: Path, base: str) -> None:
    """Set `base_model_name_or_path` in a PEFT `adapter_config.json` (PEFT and vLLM read it
    to find the model the adapter belongs to)."""
    fields = json.loads(adapter_config.read_text())
    fields["base_model_name_or_path"] = base
    adapter_config.write_text(json.dumps(fields, indent=2))


def normal_modes(root: Path, *, root_too: bool = True) -> None:
    """Give every file and folder under `root` (and `root` itself with `root_too`) the mode
    a new file or folder gets here: 0666 / 0777 less the umask. safetensors writes 0600, and
    copies keep the checkpoint's modes."""
    mask = os.umask(0)
    os.umask(mask)  # reading the umask means setting it; this is a one-thread CLI
    if root_too:
        root.chmod(0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            Path(folder, name).chmod(0o777 & ~mask)
        for name in files:
            Path(folder, name).chmod(0o666 & ~mask)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def merge_adapter(adapter_dir: Path, base_model: Path, out: Path) -> Path:
    """The base model with the adapter merged in, saved as an HF directory (float32 merge,
    saved in the base's dtype)."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base_model))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    with no_progress_bars():  # "Loading weights", "Writing model shards": `tandem export` prints one line
        base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        merged.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).save_pretrained(
            out, safe_serialization=True
        )
    for name in TOKENIZER_FILES:
        if (base_model / name).exists():
            shutil.copy2(base_model / name, out / name)
    return out


def consolidate(actor_dir: Path, source_model: Path, out: Path) -> Path:
    """Sharded actor checkpoint → HF directory, on CPU, without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(actor_dir), str(flat))
        state = torch.load(flat, weights_only=False)["model"]
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(str(source_model))
        model.load_state_dict(state, strict=False)
        model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source_model / name).exists():
            shutil.copy2(source_model / name, out / name)
    return out
