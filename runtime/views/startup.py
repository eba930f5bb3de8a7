"""Start-up progress on the launcher's console: a vLLM engine start takes minutes, and
nothing else is printed meanwhile.

`EngineStarts` follows the roles' `engine_starting` / `engine_started` records. While an
engine is starting, `due(now)` gives one line per starting engine at least every
`EVERY_S` seconds, each with the time since its start and, when the role's output file
(`logs/NAME.out`) has one, vLLM's last log line there (what it is doing: loading weights,
profiling memory, compiling). A role's `ready`, `fatal` or exit ends its start.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

EVERY_S = 10.0  # under the 15 s a person waits before wondering whether it hangs
TAIL_BYTES = 4096
# vLLM's line prefix: `INFO 12-07 05:01:02 [loader.py:123] `, or `(EngineCore pid=1) INFO ...`
VLLM_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:INFO|WARNING|DEBUG) \d\d-\d\d [\d:.]+ \[[^\]]*\] ")


@dataclass
class _Start:
    began: float  # monotonic
    said: float  # monotonic: the last line printed about it


class EngineStarts:
    def __init__(self, logs: Path | None, *, every_s: float = EVERY_S) -> None:
        """`logs`: the run's log folder, where each role's output file is (None: none read)."""
        self.logs = logs
        self.every_s = every_s
        self.starting: dict[str, _Start] = {}

    def seen(self, who: str, event: str, now: float | None = None) -> None:
        """A record `event` of role `who` (`rollout-0`)."""
        now = time.monotonic() if now is None else now
        if event == "engine_starting":
            self.starting[who] = _Start(began=now, said=now)
        elif event in ("engine_started", "ready", "fatal", "stopped_before_ready"):
            self.starting.pop(who, None)

    def due(self, now: float | None = None) -> list[tuple[str, str]]:
        """(who, text) for each engine whose last line is `every_s` old."""
        now = time.monotonic() if now is None else now
        lines = []
        for who, start in self.starting.items():
            if now - start.said >= self.every_s:
                start.said = now
                doing = self.last_vllm_line(who)
                lines.append((who, f"still starting vLLM engine: {now - start.began:.0f} s{doing and f' ({doing})'}"))
        return lines

    def last_vllm_line(self, who: str) -> str:
        """vLLM's last log line in `who`'s output file, its prefix cut ("" when none)."""
        if self.logs is None:
            return ""
        try:
            with open(self.logs / f"{who}.out", "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - TAIL_BYTES))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        for line in reversed(tail.splitlines()):
            if VLLM_PREFIX.match(line):
                text = VLLM_PREFIX.sub("", line).strip()
                return text if len(text) <= 100 else text[:97] + "..."
        return ""
