"""Garbage-collector pauses in a role process: keep them short, and say when one is long.

A role holds millions of long-lived objects once set up (vLLM's engine, torch modules,
the tokenizer), and every full collection used to walk them all: with a busy rollout
(hundreds of streams allocating per engine step) that is a pause of the role's event
loop — weight updates, heartbeats and completions all wait behind it.

`settle()` (called by every role once set up): collect once, then `gc.freeze()`, so the
objects alive at that point are never scanned again (they stay alive; nothing is freed
that a collection would have freed). `watch(threshold_s)`: log `gc_pause` for every
collection longer than the threshold (generation, seconds, objects collected), at most
`limit` times per process, so a pause that remains is visible in the role's log.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from runtime.logs import get_logger

log = get_logger("gc")


def settle() -> int:
    """Collect, then freeze what is left; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PauseWatch:
    def __init__(self, threshold_s: float = 0.05, limit: int = 100) -> None:
        self.threshold_s = threshold_s
        self.limit = limit
        self.logged = 0
        self.longest_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        self.longest_s = max(self.longest_s, seconds)
        if seconds >= self.threshold_s and self.logged < self.limit:
            self.logged += 1
            log.warning(
                "gc_pause", generation=info.get("generation"), seconds=round(seconds, 4),
                collected=info.get("collected"),
            )  # fmt: skip


def watch(threshold_s: float = 0.05, limit: int = 100) -> PauseWatch:
    """Log collections of `threshold_s` or longer (the first `limit` of them)."""
    watcher = PauseWatch(threshold_s, limit)
    gc.callbacks.append(watcher)
    return watcher
