"""The identity of a run's base model, recorded in every checkpoint's manifest.

`identity(model_dir)` is `{"path": resolved path, "digest": sha256}`; the digest covers
the bytes of `config.json` and, for every weight file (`*.safetensors`, `*.bin`, `*.pt`),
its name, its size and the bytes of its first and last MiB. That reads a few MiB however
large the model is, and still tells apart two random initialisations of one shape (their
first weights differ) or two fine-tunes of one architecture. It ignores mtimes, so a copy
of the same model, or the tiny model rebuilt with the same arguments, is the same model.

Resume and `tandem export` compare the checkpoint's record with the model the run would
use now (`mismatch`), and refuse in one line naming both when they differ.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
EDGE = 1 << 20
MANIFEST_KEY = "base_model"


def identity(model_dir: Path) -> dict[str, str]:
    h = hashlib.sha256()
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(EDGE))
            if size > EDGE:
                fh.seek(max(EDGE, size - EDGE))
                h.update(fh.read(EDGE))
    return {"path": str(model_dir.resolve()), "digest": h.hexdigest()[:16]}


def mismatch(checkpoint: Path, manifest: dict[str, Any], model_dir: Path) -> str:
    """ "" when `checkpoint` was trained on the model now at `model_dir` (or predates the
    record); else one line naming both."""
    saved = manifest.get(MANIFEST_KEY)
    if not saved:
        return ""
    if not model_dir.is_dir():
        return (
            f"checkpoint {checkpoint} was trained on base model {saved['path']} (digest {saved['digest']}), "
            f"but {model_dir} does not exist"
        )
    now = identity(model_dir)
    if now["digest"] == saved["digest"]:
        return ""
    return (
        f"checkpoint {checkpoint} was trained on base model {saved['path']} (digest {saved['digest']}), "
        f"but the run's model is now {now['path']} (digest {now['digest']}): another model"
    )
