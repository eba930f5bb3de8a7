"""A log throttle for warnings a peer can cause once per message it sends.

What a caller may rely on: `Throttled(log).warning(event, key=..., **fields)` logs the
first `first` (3) of each event (and `key`, when one event covers several kinds) with
their fields and `count`, then only one summary line at the
10th, 100th, 1000th... (`count`, `unlogged`: how many were not logged, and `key` when one
was given), so N messages cost at most `first + log10(N)` lines per event and key.
"""

from __future__ import annotations

from typing import Any


class Throttled:
    """Per-event counts of warnings (a refusal, an ignored or an unexpected message)."""

    def __init__(self, log: Any, first: int = 3) -> None:
        self.log = log
        self.first = first
        self.counts: dict[tuple[str, str], int] = {}

    def warning(self, event: str, *, key: str = "", **fields: Any) -> None:
        n = self.counts[event, key] = self.counts.get((event, key), 0) + 1
        if n <= self.first:
            self.log.warning(event, count=n, **fields)
        elif n >= 10 and str(n).rstrip("0") == "1":
            keyed = {"key": key} if key else {}
            self.log.warning(event, count=n, unlogged=n - self.first, summary=True, **keyed)
