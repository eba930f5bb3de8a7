"""How a benchmark hands its result over: one JSON object on stdout, and the same text in a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def print_json(result: dict[str, Any], out: Path | None) -> None:
    """Print `result` as one JSON line and, given `out`, write the same line there (its
    folder made if missing)."""
    text = json.dumps(result)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


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
