"""Structured JSON logs: one file per role process, one JSON object per line.

Every line carries `ts` (epoch seconds, float), `time` (ISO 8601 UTC), `level`, `role`,
`rank`, `pid`, `event`, the current policy `version` once a role has set one, and the
event's own fields. Files live at `RUN_DIR/logs/<role>-<rank>.jsonl`; `tandem tail`
merges them by `ts`. Lines are written whole and flushed, so a reader following the
file never sees half a line unless it catches the writer mid-write.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import msgspec
import structlog
from structlog.typing import EventDict, WrappedLogger

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_STATE: dict[str, Any] = {}
_json = msgspec.json.Encoder(enc_hook=repr)


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
        processors=[_stamp, structlog.processors.format_exc_info, _Writer(sink)],
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
    def __init__(self, sink: TextIO) -> None:
        self.sink = sink

    def __call__(self, _: WrappedLogger, __: str, event: EventDict) -> str:
        line = _json.encode(event).decode()
        self.sink.write(line + "\n")
        self.sink.flush()
        raise structlog.DropEvent


def get_logger(name: str = "tandem") -> Any:
    return structlog.get_logger(name)
