"""Structured JSON logs: one file per role process, one JSON object per line.

Every line carries `ts` (epoch seconds, float), `time` (ISO 8601 UTC), `level`, `role`,
`rank`, `pid`, `event`, the current policy `version` once a role has set one, and the
event's own fields. Files live at `RUN_DIR/logs/<role>-<rank>.jsonl`; `tandem tail`
merges them by `ts`. Lines are written whole and flushed, so a reader following the
file never sees half a line unless it catches the writer mid-write.

A float that is NaN or infinite is written as the text "nan", "inf" or "-inf" (JSON has no
such numbers; msgspec would write null, Python's json an invalid `NaN`), at any depth of a
field (`json_ready`); metrics.jsonl writes them the same way, and runtime/views/records.py reads
both back as floats.

A line that cannot be written (disk full, I/O error) never raises into the code that
logged it: the writer stops writing, and `on_write_error(callback)` callbacks get a
one-line cause naming the file (the role fails with it: runtime/role.py).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import msgspec
import structlog
from structlog.typing import EventDict, WrappedLogger

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_STATE: dict[str, Any] = {}
_json = msgspec.json.Encoder(enc_hook=repr)
_ON_WRITE_ERROR: list[Callable[[str], object]] = []


def on_write_error(callback: Callable[[str], object]) -> None:
    """Call `callback(cause)` once when a log line cannot be written."""
    _ON_WRITE_ERROR.append(callback)


def json_ready(obj: Any) -> Any:
    """`obj` with every NaN / +inf / -inf float in it (in dicts, lists and tuples at any
    depth) replaced by the text "nan" / "inf" / "-inf"; `obj` itself when it holds none."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else "nan" if obj != obj else "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_ready(v) for v in obj]
    return obj


def log_path(run_dir: str | Path, role: str, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"{role}-{rank}.jsonl"


def set_policy_version(version: int) -> None:
    """Stamp `version` on every following log line of this process."""
    _STATE["version"] = version


def setup_logging(
    run_dir: str | Path | None,
    role: str,
    rank: int = 0,
    *,
    level: str = "info",
    stream: TextIO | None = None,
) -> Path | None:
    """Route structlog to RUN_DIR/logs/<role>-<rank>.jsonl (or `stream` when no run dir)."""
    _STATE.clear()
    _STATE.update(role=role, rank=rank, pid=os.getpid())
    path = None
    if run_dir is not None:
        path = log_path(run_dir, role, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        sink: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 (lives for the process)
    else:
        sink = stream or sys.stderr
    structlog.configure(
        processors=[_stamp, structlog.processors.format_exc_info, _Writer(sink, str(path or "the log stream"))],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        cache_logger_on_first_use=False,
    )
    logging.getLogger("vllm").setLevel(logging.WARNING)
    return path


def _stamp(_: WrappedLogger, method: str, event: EventDict) -> EventDict:
    now = time.time()
    head = {
        "ts": round(now, 6),
        "time": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": "warning" if method == "warn" else method,
        "role": _STATE.get("role", "?"),
        "rank": _STATE.get("rank", 0),
        "pid": _STATE.get("pid", os.getpid()),
        "event": event.pop("event", ""),
    }
    if "version" in _STATE and "version" not in event:
        head["version"] = _STATE["version"]
    head.update(event)
    return head


class _Writer:
    def __init__(self, sink: TextIO, where: str) -> None:
        self.sink = sink
        self.where = where
        self.broken = ""  # why lines are no longer written

    def __call__(self, _: WrappedLogger, __: str, event: EventDict) -> str:
        if not self.broken:
            line = _json.encode(json_ready(event)).decode()
            try:
                self.sink.write(line + "\n")
                self.sink.flush()
            except OSError as exc:
                self.broken = f"I/O error writing its log {self.where}: {exc.strerror or exc}"
                for callback in _ON_WRITE_ERROR:
                    callback(self.broken)
        raise structlog.DropEvent


def get_logger(name: str = "tandem") -> Any:
    return structlog.get_logger(name)
