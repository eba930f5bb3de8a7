"""What an engine's `export_weights` stream (full tensors by HF name) is turned into.

`export_hf` writes the policy as an HF model directory (what vLLM and transformers load).
It is a collective over the trainer ranks: every rank gathers full tensors; rank 0 writes
`model.safetensors` in the export dtype plus the config and tokenizer files of the source
model directory. Tied weights are written once (the config ties them again).
Tensors may come on any device (the FSDP engine exports on its own); they are written
from the CPU.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def export_hf(items: Iterator[tuple[str, torch.Tensor]], rank: int, source: Path, out: Path) -> None:
    """Consume `items` on every rank; rank 0 writes the HF directory `out`."""
    if rank != 0:
        for _ in items:
            pass
        return
    from safetensors.torch import save_file

    tensors = {name: t.detach().cpu().contiguous() for name, t in items}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)
