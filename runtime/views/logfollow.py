"""Incremental reading of a run's JSON log files.

`LogFollower(logs_dir).poll()` returns the complete lines appended to any
`*.jsonl` file since the previous call, parsed, sorted by `ts`. Files that appear later
are picked up; a trailing partial line is held back until its newline arrives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class LogFollower:
    def __init__(self, logs_dir: str | Path, pattern: str = "*.jsonl", *, from_end: bool = False) -> None:
        """`from_end`: skip what the files hold already (a resumed run's earlier lines)."""
        self.dir = Path(logs_dir)
        self.pattern = pattern
        self._offsets: dict[Path, int] = {}
        if from_end and self.dir.is_dir():
            self._offsets = {p: p.stat().st_size for p in self.dir.glob(pattern)}

    def poll(self) -> list[dict[str, Any]]:
        """New complete records of every file, merged by time."""
        records: list[dict[str, Any]] = []
        if not self.dir.is_dir():
            return records
        for path in sorted(self.dir.glob(self.pattern)):
            records.extend(self._read_new(path))
        records.sort(key=lambda r: r.get("ts", 0.0))
        return records

    def _read_new(self, path: Path) -> list[dict[str, Any]]:
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self._offsets[path] = offset + end + 1
        out = []
        for raw in chunk[: end + 1].splitlines():
            out.append(parse_line(raw.decode(errors="replace"), path))
        return out


def parse_line(line: str, path: Path) -> dict[str, Any]:
    """A log record; a line that is not a JSON object becomes a `raw` record."""
    try:
        rec = json.loads(line)
        if isinstance(rec, dict):
            return rec
    except json.JSONDecodeError:
        pass
    role, _, rank = path.stem.rpartition("-")
    return {"ts": 0.0, "level": "info", "role": role or path.stem, "rank": rank, "event": "raw", "text": line}


def last_error(logs_dir: str | Path, name: str) -> str:
    """The cause of the newest error line of role `name` (e.g. "trainer-1"), or its output tail."""
    path = Path(logs_dir) / f"{name}.jsonl"
    cause = ""
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            rec = parse_line(line, path)
            if rec.get("level") in ("error", "critical") and rec.get("event") != "traceback":
                cause = str(rec.get("cause") or rec.get("error") or rec.get("event"))
    if cause:
        return cause
    out = Path(logs_dir) / f"{name}.out"
    if out.exists():
        lines = [ln for ln in out.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        if errors:
            return errors[-1].strip()[:500]
    return "no error was logged"
