"""How a benchmark hands its result over: one JSON object on stdout, and the same text in a file,
stamped with when, where and from what code it ran (`provenance`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from runtime.errors import one_line

ROOT = Path(__file__).resolve().parent.parent


def print_json(result: dict[str, Any], out: Path | None) -> None:
    """Print `result` as one JSON line and, given `out`, write the same line there (its
    folder made if missing)."""
    text = json.dumps(result)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def one_line_error(exc: BaseException) -> str:
    """How a result records a part that failed while the others went on: the exception's
    type and the first line of its message."""
    return one_line(exc, line=0)


def gpu_name() -> str | None:
    """GPU 0's name as nvidia-smi gives it ("NVIDIA H100 80GB HBM3"), None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """When, where and from what code a repeat ran: `measured_at` (UTC), `host`, `gpu` (GPU
    0's name, None on a machine without one) and `commit` (`$TANDEM_COMMIT` where set, as on
    a machine whose copy of the tree has no true git history; else git's short HEAD, `-dirty`
    with uncommitted changes; None without git)."""
    commit = os.environ.get("TANDEM_COMMIT") or None
    if commit is None:
        try:
            head = subprocess.run(
                ["git", "describe", "--always", "--dirty", "--abbrev=7"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=30,
            )
            commit = (head.stdout.strip() or None) if head.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            commit = None
    return {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "gpu": gpu_name(),
        "commit": commit,
    }


def read_earlier(
    path: Path, benchmark: str, needs: str, now: dict[str, Any], *, asker: str = "", option: str = ""
) -> dict[str, Any]:
    """An earlier result of `benchmark` (`--add-to FILE`), measured as `now` says: every key
    of `now` must hold the same value there. Refused (SystemExit, one line naming the file
    and the first key that differs) when the file cannot be read, is not a result of
    `benchmark` holding `needs`, or was measured otherwise. The line starts `ASKER: OPTION:`
    (by default `BENCHMARK: --add-to PATH:`), for another benchmark reading this one's result."""
    where = f"{asker or benchmark}: {option or f'--add-to {path}'}"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{where}: not a readable JSON file ({exc})") from None
    if not isinstance(old, dict) or old.get("benchmark") != benchmark or needs not in old:
        raise SystemExit(f"{where}: not a result of benchmarks/{benchmark}.py")
    for key, value in now.items():
        if old.get(key) != value:
            raise SystemExit(f"{where}: {key} was {old.get(key)!r}, now {value!r}")
    return old
