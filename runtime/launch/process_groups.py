"""Which processes of a process group are still alive (Linux /proc).

The launcher starts every role in its own session, so a role's process group holds the
role and everything it spawned (vLLM's engine processes). A SIGKILLed process is not gone
at once: the kernel first tears down its GPU context, which can take seconds for a large
one, and only then is the memory free for the next run. `wait_gone` waits for that.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path


def live_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that have not exited (zombies, already exited and
    holding nothing but their table entry, are not counted)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def wait_gone(pgids: Iterable[int], timeout_s: float) -> dict[int, list[int]]:
    """Wait up to `timeout_s` until no process of any group in `pgids` is alive; returns
    the groups that still have live members, with their pids (empty when all are gone)."""
    groups = list(pgids)
    deadline = time.monotonic() + timeout_s
    while True:
        left = {g: pids for g in groups if (pids := live_members(g))}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


__all__ = ["live_members", "wait_gone"]
