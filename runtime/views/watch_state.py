"""What `tandem watch` shows, read incrementally from a run directory: each role's status
from its log (logs/ROLE-RANK.jsonl), the steps from metrics.jsonl, and the groups each
rollout has in flight from schedule.jsonl.

What a caller may rely on: `RunState(run_dir).poll()` reads only what was appended since
the previous call (a half-written line waits for its newline; a schedule file that rotated
is read again from its start), so it can be called every second on a long run. A metrics or
schedule line that is not JSON or not a valid record (runtime/views/records.py) is skipped and
counted in `num_skipped()`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.identity.paths import METRICS, SCHEDULE
from runtime.views.logfollow import LogFollower
from runtime.views.records import metric, usable_metrics, usable_schedule
from runtime.views.wall_clock import run_wall_s

FINAL_EVENTS = {"stop_requested": "stopping", "channel_closed": "stopping", "fatal": "failed", "role_died": "failed"}


@dataclass
class RoleStatus:
    name: str
    pid: int = 0
    version: int | None = None
    last_ts: float = 0.0
    last_event: str = ""
    state: str = "starting"  # starting | ready | stopping | failed (the launcher: running)

    def alive(self) -> bool | None:
        """Whether its process exists (None: no pid logged yet, or not on this host)."""
        if not self.pid:
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class JsonlTail:
    """The complete lines appended to one file since the previous `read` that are records
    `usable` accepts; `skipped` counts the others."""

    def __init__(self, path: Path, usable: Callable[[Any], bool]) -> None:
        self.path = path
        self.usable = usable
        self.offset = 0
        self.skipped = 0

    def read(self) -> Iterator[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self.offset:  # rotated or truncated: a new file
            self.offset = 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        for raw in chunk[: end + 1].splitlines():
            try:
                rec = json.loads(raw.decode(errors="replace"))
            except ValueError:
                rec = None
            if self.usable(rec):
                yield rec
            elif raw.strip():
                self.skipped += 1


class RunState:
    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.logs = LogFollower(self.run_dir / "logs")
        self.metrics = JsonlTail(self.run_dir / METRICS, usable_metrics)
        self.schedule = JsonlTail(self.run_dir / SCHEDULE, usable_schedule)
        self.roles: dict[str, RoleStatus] = {}
        self.steps: list[dict[str, Any]] = []
        self.validation: list[dict[str, Any]] = []
        self.in_flight: dict[int, str] = {}  # group id -> rollout
        self.rollouts: set[str] = set()
        self.total_steps = _total_steps(self.run_dir)
        self.polled_at = 0.0

    def poll(self) -> None:
        for rec in self.logs.poll():
            self._log(rec)
        for rec in self.metrics.read():
            (self.validation if rec.get("kind") == "validation" else self.steps).append(rec)
        for rec in self.schedule.read():
            self._schedule(rec)
        self.polled_at = time.time()

    def num_skipped(self) -> int:
        return self.metrics.skipped + self.schedule.skipped

    def has_schedule(self) -> bool:
        return self.schedule.path.exists()

    def in_flight_of(self, rollout: str) -> int:
        return sum(1 for r in self.in_flight.values() if r == rollout)

    def wall_s(self) -> float | None:
        """The run's wall time as of the last `poll` (runtime.views.wall_clock; None: unknown)."""
        return run_wall_s(self.run_dir, now=self.polled_at or None)

    def step_rate(self, window: int = 10) -> float:
        """Steps per second over the last `window` steps (0 until two are in)."""
        recent = self.steps[-window - 1 :]
        if len(recent) < 2:
            return 0.0
        dt = metric(recent[-1], "wall_s") - metric(recent[0], "wall_s")
        return (len(recent) - 1) / dt if dt > 0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.step_rate()
        if not self.steps or not self.total_steps or not rate:
            return None
        return max(0, self.total_steps - int(self.steps[-1]["step"])) / rate

    def _log(self, rec: dict[str, Any]) -> None:
        role, rank = rec.get("role"), rec.get("rank")
        if role is None or rec.get("event") == "raw":
            return
        name = f"{role}-{rank}"
        st = self.roles.setdefault(name, RoleStatus(name, state="running" if role == "launcher" else "starting"))
        st.pid = int(rec.get("pid") or st.pid)
        st.last_ts = max(st.last_ts, float(rec.get("ts", 0.0)))
        st.last_event = str(rec.get("event", ""))
        if isinstance(rec.get("version"), int):
            st.version = rec["version"]
        if st.last_event == "ready" and st.state == "starting":
            st.state = "ready"
        elif st.last_event in FINAL_EVENTS and st.state != "failed":
            st.state = FINAL_EVENTS[st.last_event]
        elif rec.get("level") in ("error", "critical"):
            st.state = "failed"

    def _schedule(self, rec: dict[str, Any]) -> None:
        ev = rec.get("ev")
        if ev == "dispatch":
            self.in_flight[int(rec["g"])] = str(rec["to"])
            self.rollouts.add(str(rec["to"]))
        elif ev in ("sampled", "requeue"):
            self.in_flight.pop(int(rec["g"]), None)
        elif ev == "run":  # a (re)start: what was in flight before died with the old controller
            self.in_flight = {}
        elif ev == "val":  # the round is over: its groups not back were cancelled
            self.in_flight = {g: r for g, r in self.in_flight.items() if g >= 0}


def _total_steps(run_dir: Path) -> int:
    import yaml

    try:
        return int(yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["total_steps"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return 0
