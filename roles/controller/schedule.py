"""The schedule log: RUN_DIR/schedule.jsonl, one compact JSON object per event the
controller sees, so a person (or `tandem report`) can see *when* things happened.

Every record has `ev` (the event) and `t` (Unix time in seconds, 3 decimals; absolute, so
the records of a resumed run line up after the ones before). What a caller may rely on:

* `run` opens every controller's records (`step`, `version`, `next_g`: where it starts; a
  resumed run starts at its checkpoint, so the records of later steps and of groups
  `next_g` and up before it are superseded by what follows).
* Groups (`g` = the ledger's group id; validation groups are negative):
  `admit` (`v`: trainer version at admission, `uid`: the prompt), `dispatch` (`to`: the
  rollout, `try`: the attempt), `requeue` (its rollout was lost; it is generated again),
  `sampled` (all samples in: `t0` the earliest sample's generation start, `t` the last
  sample's arrival, `vmin` / `vmax` the policy versions its tokens carry, `tok` response
  tokens, `to` the rollout), `scored`, and `drop` (`why`: stale, error or filtered, and
  `detail`).
* `step`: one per trainer step, written when the step is trained: `step` N, `version`
  published, `t0` / `t` when the batch went to the trainer and the reply came,
  `groups` (the gids trained at this step: every trained group is in exactly one `step`
  record), `train_s` and `sync_s` (the trainer's compute and weight-sync time) and the
  sync's phases (`gather_s`, `transfer_s`, `load_s`) when the trainer reports them; with
  the step's phases (runtime/step_phases.py), `w0` / `w1` (Unix times the step's window
  opened and closed), `phases` (`[phase, from, to]` lists, seconds from `w0`) and `glue_s`.
* `sync`: one rollout applied `version`: `to`, `t0` / `t` (start, end), `receive_s`, `load_s`.
* `val`: a validation round: `step`, `version`, `t0` / `t`, `groups`.

Writes are buffered (flushed at every `step` record, every `FLUSH_S` and on `close`), so a
crashed run loses at most the last second. When the file passes `max_bytes` it is renamed to
`schedule.1.jsonl` (replacing an older one) and a new file begins: at most twice
`max_bytes` on disk; `tandem report` (runtime/views/report/load.py) reads both, in order.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runtime.identity.paths import SCHEDULE_ROTATED
from runtime.step_phases import StepTimes, phase_metrics, phase_spans

FLUSH_S = 1.0
FLUSH_RECORDS = 512
ROTATED = SCHEDULE_ROTATED


class ScheduleLog:
    """Appends the schedule records of one controller to `path` (see the module docstring)."""

    def __init__(self, path: Path, *, max_bytes: int = 64 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._buf: list[str] = []
        self._closed = False
        self._last_flush = time.monotonic()
        self._file = open(path, "a")  # noqa: SIM115 (lives with the controller)
        self._size = self._file.tell()

    # --- run and groups ----------------------------------------------------------------
    def run(self, step: int, version: int, next_gid: int) -> None:
        self._emit({"ev": "run", "step": step, "version": version, "next_g": next_gid})

    def admit(self, gid: int, version: int, uid: int) -> None:
        self._emit({"ev": "admit", "g": gid, "v": version, "uid": uid})

    def dispatch(self, gid: int, rollout: str, attempt: int) -> None:
        self._emit({"ev": "dispatch", "g": gid, "to": rollout, "try": attempt})

    def requeue(self, gid: int) -> None:
        self._emit({"ev": "requeue", "g": gid})

    def sampled(self, gid: int, rollout: str, started: float, vmin: int, vmax: int, tokens: int) -> None:
        """`started`: Unix time the group's earliest sample began generating."""
        self._emit(
            {
                "ev": "sampled",
                "g": gid,
                "to": rollout,
                "t0": round(started, 3),
                "vmin": vmin,
                "vmax": vmax,
                "tok": tokens,
            }
        )

    def teacher(self, gid: int, teacher: str, seconds: float, tokens: int, failed: int) -> None:
        """The distillation teacher answered group `gid`: in `seconds`, `tokens` scored,
        `failed` samples without log-probabilities."""
        self._emit({"ev": "teacher", "g": gid, "to": teacher, "s": round(seconds, 4), "tok": tokens, "fail": failed})

    def scored(self, gid: int) -> None:
        self._emit({"ev": "scored", "g": gid})

    def drop(self, gid: int, reason: str, detail: str = "") -> None:
        self._emit({"ev": "drop", "g": gid, "why": reason, "detail": detail})

    # --- steps, weights, validation ------------------------------------------------------
    def step(
        self,
        step: int,
        version: int,
        started: float,
        gids: Iterable[int],
        trainer: dict[str, float],
        times: StepTimes | None = None,
    ) -> None:
        """Step `step` trained `gids` and published `version`; `started`: Unix time the batch
        went out; `trainer`: the trainer's metrics (its times are picked from them); `times`:
        what the step's phases are computed from."""
        rec: dict[str, Any] = {
            "ev": "step",
            "step": step,
            "version": version,
            "t0": round(started, 3),
            "groups": list(gids),
        }
        for key, name in (
            ("train_s", "train_s"),
            ("weight_sync_s", "sync_s"),
            ("weight_sync_gather_s", "gather_s"),
            ("weight_sync_transfer_s", "transfer_s"),
            ("weight_sync_load_s", "load_s"),
        ):
            if key in trainer:
                rec[name] = round(float(trainer[key]), 4)
        if times is not None:
            spans = [[n, round(a, 3), round(b, 3)] for n, a, b in phase_spans(times)]
            glue = round(phase_metrics(times)["step_glue_s"], 4)
            rec.update(w0=round(times.start, 3), w1=round(times.end, 3), phases=spans, glue_s=glue)
        self._emit(rec)
        self.flush()

    def sync(self, rollout: str, version: int, total_s: float, receive_s: float, load_s: float) -> None:
        """A rollout reported it applied `version` now, after `total_s` seconds."""
        now = time.time()
        self._emit(
            {
                "ev": "sync",
                "to": rollout,
                "version": version,
                "t0": round(now - total_s, 3),
                "receive_s": round(receive_s, 4),
                "load_s": round(load_s, 4),
            },
            now,
        )

    def validation(self, step: int, version: int, started: float, groups: int) -> None:
        self._emit({"ev": "val", "step": step, "version": version, "t0": round(started, 3), "groups": groups})

    # --- file ------------------------------------------------------------------------------
    def flush(self) -> None:
        if self._buf and not self._closed:
            text = "".join(self._buf)
            self._buf.clear()
            if self._size and self._size + len(text) > self.max_bytes:
                self._rotate()
            self._file.write(text)
            self._file.flush()
            self._size += len(text)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Write what is buffered and stop (later events are ignored; a second close is a no-op)."""
        self.flush()
        self._closed = True
        self._file.close()

    def _emit(self, rec: dict[str, Any], now: float | None = None) -> None:
        if self._closed:
            return
        rec["t"] = round(now if now is not None else time.time(), 3)
        self._buf.append(json.dumps(rec, separators=(",", ":")) + "\n")
        if len(self._buf) >= FLUSH_RECORDS or time.monotonic() - self._last_flush > FLUSH_S:
            self.flush()

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path.with_name(ROTATED))
        self._file = open(self.path, "a")  # noqa: SIM115
        self._size = 0


class NoSchedule(ScheduleLog):
    """A schedule log that writes nothing (`metrics.schedule: false`, and unit tests)."""

    def __init__(self) -> None:
        self._buf = []

    def _emit(self, rec: dict[str, Any], now: float | None = None) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None
