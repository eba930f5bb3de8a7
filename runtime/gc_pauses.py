"""Garbage-collector pauses in a role process: keep them short, and say when one is long.

A role holds millions of long-lived objects once set up (vLLM's engine, torch modules,
the tokenizer), and every full collection used to walk them all: with a busy rollout
(hundreds of streams allocating per engine step) that is a pause of the role's event
loop — weight updates, heartbeats and completions all wait behind it.

`settle()` (called by every role once set up): collect once, then `gc.freeze()`, so the
objects alive at that point are never scanned again (they stay alive; nothing is freed
that a collection would have freed). `watch(threshold_s)`: log `gc_pause` for every
collection longer than the threshold on the wall clock (generation, seconds, cpu_s, objects
collected), at most `limit` times per process, so a pause that remains is visible in the
role's log.

Pauses go to the role's JSON log at info, never to the console, with one exception: a
collection that spent `warn_cpu_s` (1 s) or more of the thread's CPU time is a warning, once
per process. That is the collector walking objects `settle` should have frozen, long enough
to hold up heartbeats and weight updates, and worth a report. Shorter ones (a third of a
second of CPU with the role's loop busy, 0.8 s on the wall clock on a loaded box) happen in
ordinary runs and are nothing a user can act on; a pause long on the wall clock but short on
CPU is the OS running other processes meanwhile.
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


WARN_CPU_S = 1.0  # a collection this long on the CPU holds up heartbeats and weight updates


class PauseWatch:
    """A `gc.callbacks` entry; `logged` and `warned` count the pauses logged and warned of,
    `longest_s` is the longest on the wall clock."""

    def __init__(self, threshold_s: float = 0.05, limit: int = 100, warn_cpu_s: float = WARN_CPU_S) -> None:
        self.threshold_s = threshold_s
        self.warn_cpu_s = warn_cpu_s
        self.limit = limit
        self.logged = 0
        self.warned = 0
        self.longest_s = 0.0
        self._started = (0.0, 0.0)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = (time.perf_counter(), time.thread_time())  # gc runs in the allocating thread
            return
        seconds = time.perf_counter() - self._started[0]
        cpu_s = time.thread_time() - self._started[1]
        self.longest_s = max(self.longest_s, seconds)
        if seconds < self.threshold_s or self.logged >= self.limit:
            return
        self.logged += 1
        warn = cpu_s >= self.warn_cpu_s and not self.warned  # once: the log has every later one
        self.warned += warn
        (log.warning if warn else log.info)(
            "gc_pause",
            generation=info.get("generation"),
            seconds=round(seconds, 4),
            cpu_s=round(cpu_s, 4),
            collected=info.get("collected"),
        )


def watch(threshold_s: float = 0.05, limit: int = 100, warn_cpu_s: float = WARN_CPU_S) -> PauseWatch:
    """Log collections of `threshold_s` or longer (the first `limit` of them); warn of the
    first that used `warn_cpu_s` of CPU or more."""
    watcher = PauseWatch(threshold_s, limit, warn_cpu_s)
    gc.callbacks.append(watcher)
    return watcher
