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
