"""Checkpoint directories: atomic commit, validation, discovery for `resume=auto`.

Layout of `RUN_DIR/checkpoints/step-00000010/` (a complete checkpoint):

    actor/        torch.distributed.checkpoint shards of the policy and its optimizer,
                  plus extra-rank<r>.pt (scheduler, RNG, version) per trainer rank
    critic/       the same for the value model (PPO with GAE)
    hf/           the policy as an HF model directory (safetensors) for vLLM / transformers
    adapter/      instead of hf/ with trainer.lora: the PEFT adapter directory (the base is
                  the run's model.path)
    controller.json   dataset cursor, gate, step, accepted-but-untrained samples, prompts in flight
    manifest.json     written last: every file's size, and sha256 of files up to 64 MiB

Writers fill `.tmp-step-N/`; `commit` writes the manifest and renames the folder, so a
crash mid-write never leaves something that looks complete. `find_latest` returns the
newest checkpoint whose manifest matches its files, and warns (naming it) about every
newer one that is partial or corrupt.

A save that fails (a full disk, an I/O error) leaves the checkpoints before it as they
were: `save_failure` is the one line that ends the run, naming the folder, the cause (a
full file system as `No space left on device (ENOSPC)`, even where torch's writer hid the
errno) and the newest intact checkpoint, the one `resume=auto` continues from.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.config import RunConfig
from runtime.config.placement import role_counts
from runtime.identity.paths import CHECKPOINTS
from runtime.logs import get_logger

log = get_logger("checkpoint")
MANIFEST = "manifest.json"
HASH_LIMIT = 64 << 20
RESUME_ENV = "TANDEM_RESUME_DIR"
FULL_BELOW = 64 << 20  # a file system with less free after a failed write is taken as full


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def begin(run_dir: str | Path, step: int) -> Path:
    """A fresh temporary folder for checkpoint `step` (a stale one is removed)."""
    tmp = checkpoints_root(run_dir) / f".tmp-{step_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, step: int, meta: dict[str, Any], keep: int = 0) -> Path:
    """Write the manifest, move `tmp` into place, prune to the `keep` newest."""
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = str(path.relative_to(tmp))
        size = path.stat().st_size
        files[rel] = {"size": size, "sha256": _sha256(path) if size <= HASH_LIMIT else None}
    manifest = {"step": step, "created": time.time(), "files": files, **meta}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    final = tmp.parent / step_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if keep > 0:
        for old in complete_dirs(final.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def complete_dirs(root: Path) -> list[Path]:
    """Checkpoint folders (not temporaries), oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def required_parts(cfg: RunConfig) -> list[str]:
    """What a complete checkpoint of this run holds: the controller's state, the actor's
    shards, the critic's when the run has one, and the HF export (the adapter with LoRA)
    when it is enabled."""
    parts = ["controller.json", "actor/"]
    if role_counts(cfg).get("critic", 0):
        parts.append("critic/")
    if cfg.checkpoint.export_hf:
        parts.append("adapter/" if cfg.trainer.lora.rank else "hf/")
    return parts


def validate(path: Path, required: Sequence[str] = ()) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; raises ValueError saying what is wrong.
    `required`: files, and folders (ending in "/") that must hold a file, a complete
    checkpoint has (`required_parts`): the manifest alone only vouches for what was written."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError("no manifest (partial checkpoint)") from None
    except json.JSONDecodeError:
        raise ValueError("manifest is not valid JSON") from None
    for rel, info in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise ValueError(f"missing file {rel}")
        if f.stat().st_size != info["size"]:
            raise ValueError(f"{rel} has {f.stat().st_size} bytes, manifest says {info['size']}")
        if info.get("sha256") and _sha256(f) != info["sha256"]:
            raise ValueError(f"{rel} does not match its checksum")
    files = manifest.get("files", {})
    for part in required:
        present = any(rel.startswith(part) for rel in files) if part.endswith("/") else part in files
        if not present:
            needed = ", ".join(required)
            raise ValueError(f"no {part.rstrip('/')} part (a complete checkpoint of this run has {needed})")
    return manifest  # type: ignore[no-any-return]


def find_latest(
    run_dir: str | Path, step: int | None = None, required: Sequence[str] = (), *, quiet: bool = False
) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint (or exactly `step`) holding every `required` part,
    warning about each one skipped (`quiet`: in the log only)."""
    for path in reversed(complete_dirs(checkpoints_root(run_dir))):
        if step is not None and path.name != step_name(step):
            continue
        try:
            return path, validate(path, required)
        except ValueError as exc:
            log.warning("checkpoint_skipped", checkpoint=str(path), reason=str(exc))
            if not quiet:
                print(f"tandem: warning: skipping checkpoint {path}: {exc}", flush=True)
    return None


def steps(run_dir: str | Path) -> list[int]:
    """The steps of the checkpoint folders under `run_dir` (intact or not), oldest first."""
    return [int(p.name.removeprefix("step-")) for p in complete_dirs(checkpoints_root(run_dir))]


def resume_dir() -> Path | None:
    """The checkpoint this process resumes from (chosen once by its launcher), or None."""
    value = os.environ.get(RESUME_ENV, "")
    return Path(value) if value else None


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())  # type: ignore[no-any-return]


def save_failure(run_dir: str | Path, step: int, cause: str) -> str:
    """The one line a failed save of checkpoint `step` ends the run with (see the module
    docstring); `cause`: what the writer said. Removes the save's temporary folder (its
    partial files would only hold the space a resume needs)."""
    root = checkpoints_root(run_dir)
    full = disk_full(root)  # measured with the partial files still there
    if not full and ("Errno 28" in cause or "No space left" in cause):
        full = f"No space left on device ({errno.errorcode[errno.ENOSPC]})"
    shutil.rmtree(root / f".tmp-{step_name(step)}", ignore_errors=True)
    latest = find_latest(run_dir, quiet=True)
    last = (
        f"the last intact checkpoint is {latest[0]} (resume=auto continues from it)"
        if latest
        else ("there is no intact checkpoint")
    )
    return f"checkpoint of step {step} into {root} failed: {full + '; ' if full else ''}{cause}; {last}"


def disk_full(path: Path) -> str:
    """'' or, when the file system holding `path` has less than FULL_BELOW free, the phrase
    naming it as full."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return ""
    if usage.free >= FULL_BELOW:
        return ""
    code = errno.errorcode[errno.ENOSPC]
    return f"No space left on device ({code}): the file system of {path} has {usage.free >> 10} KiB free"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
