"""`tandem tail`: every role's JSON log of a run, merged into one view ordered by `ts`.

Callers may rely on this:
* Only `RUN_DIR/logs/*.jsonl` is read; other files there (`*.out` captures) are ignored.
* Only whole lines (ending in a newline) are consumed; a line the writer is still writing
  is printed on the poll after it is completed, never before and never twice.
* Output is ordered by `ts`: the existing content as a whole, then each follow poll's batch.
  Equal `ts` keep file-name order, then line order.
* A line that is not a JSON object is printed as it is, under the role of its file, with
  the `ts` of the line before it; `--level` never hides it, `--grep` and `--since` can.
* Colour is used only when `out` is a terminal, so captured output is plain text.
* `run_tail` returns 0, or 2 with one line on stderr (`tandem: error: ...`) when, without
  `--follow`, the run or its `logs/` folder does not exist (with `--follow` it says on stderr
  that it waits, and waits for them, as `tail -F` does; a path that is a file is an error),
  or when a `--role` names no log there (the line lists the ones there; with `--follow` a
  role kind that has not written yet is waited for). With `--follow` it polls until the run's launcher has ended
  (runtime/views/wall_clock.py: `launcher_done`; it prints what came last, then says so on stderr),
  `stop` is set, or Ctrl-C.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import threading
import time
import typing
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import msgspec
from rich.console import Console
from rich.text import Text

from runtime.logs import LEVELS
from runtime.views.wall_clock import launcher_done

MAX_VALUE_CHARS = 200
_HEAD_KEYS = frozenset({"ts", "time", "level", "role", "rank", "pid", "event", "version"})
_ROLE_PALETTE = ("cyan", "magenta", "green", "blue", "bright_cyan", "bright_magenta", "bright_green", "bright_blue")
_LEVEL_STYLE = {"debug": "dim", "warning": "yellow", "error": "red", "critical": "bold red"}
_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder(enc_hook=repr)


def add_tail_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="Run directory (its logs/ folder is read).")
    parser.add_argument("--follow", "-f", action="store_true", help="Keep printing lines as they are written.")
    parser.add_argument("--role", action="append", default=[], help="Only this role or role-rank (repeatable).")
    parser.add_argument("--level", choices=list(LEVELS), default="debug", help="Minimum level shown.")
    parser.add_argument("--grep", default=None, help="Only raw lines containing this text (case-sensitive).")
    parser.add_argument("--json", action="store_true", help="Print the raw JSON lines.")
    parser.add_argument("--since", type=float, default=None, help="Only lines of the last SECONDS.")
    parser.add_argument("--poll", type=float, default=0.2, help="Follow poll interval in seconds.")


@dataclass(frozen=True)
class Line:
    ts: float
    raw: str
    label: str  # role-rank of the file the line came from
    fields: dict[str, Any] | None  # None when `raw` is not a JSON object


class Source:
    """One log file, read on from where the previous read stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.last_ts = 0.0

    def lines(self) -> Iterator[Line]:
        """The complete lines appended since the last call, in file order."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for chunk in f:
                if not chunk.endswith(b"\n"):
                    return
                self.offset += len(chunk)
                yield self._parse(chunk.decode("utf-8", "replace").rstrip("\r\n"))

    def _parse(self, raw: str) -> Line:
        try:
            fields = _decode.decode(raw)
        except msgspec.DecodeError:
            fields = None
        if not isinstance(fields, dict):
            return Line(self.last_ts, raw, self.path.stem, None)
        if isinstance(fields.get("ts"), int | float):
            self.last_ts = float(fields["ts"])
        return Line(self.last_ts, raw, self.path.stem, fields)


@dataclass(frozen=True)
class Filter:
    roles: tuple[str, ...]
    min_level: int
    grep: str | None
    since_ts: float | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Filter:
        since_ts = None if args.since is None else time.time() - args.since
        return cls(tuple(args.role), LEVELS[args.level], args.grep, since_ts)

    def wants_file(self, path: Path) -> bool:
        label = path.stem
        return not self.roles or label in self.roles or label.rsplit("-", 1)[0] in self.roles

    def wants(self, line: Line) -> bool:
        if self.grep is not None and self.grep not in line.raw:
            return False
        if self.since_ts is not None and line.ts < self.since_ts:
            return False
        return line.fields is None or LEVELS.get(str(line.fields.get("level")), 100) >= self.min_level


def role_style(role: str) -> str:
    """The same colour for a role name in every run and process (unlike `hash`)."""
    return _ROLE_PALETTE[zlib.crc32(role.encode()) % len(_ROLE_PALETTE)]


def format_value(value: Any) -> str:
    """Strings with whitespace are JSON-quoted so a traceback stays on its event's line."""
    plain = isinstance(value, str) and not any(char.isspace() for char in value)
    text = value if plain else _encode.encode(value).decode()
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def render(line: Line) -> Text:
    """`HH:MM:SS.mmm role-rank [v=N] LEVEL event key=value ...`, coloured by role and level."""
    if line.fields is None:
        return Text.assemble(" " * 12, " ", (line.label, role_style(line.label.rsplit("-", 1)[0])), " ", line.raw)
    fields = line.fields
    role = str(fields.get("role", line.label.rsplit("-", 1)[0]))
    level = str(fields.get("level", "info"))
    style = _LEVEL_STYLE.get(level, "")
    clock = datetime.fromtimestamp(line.ts).strftime("%H:%M:%S.%f")[:12]
    text = Text.assemble(clock, " ", (f"{role}-{fields.get('rank', '?')}", role_style(role)))
    if "version" in fields:
        text.append(f" v={fields['version']}", style=role_style(role))
    text.append(f" {level.upper():<5} ", style=style)
    text.append(str(fields.get("event", "")), style=style or "bold")
    for key, value in fields.items():
        if key not in _HEAD_KEYS:
            text.append(f" {key}={format_value(value)}")
    return text


class Printer:
    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.console = Console(
            file=out, force_terminal=out.isatty(), highlight=False, markup=False, emoji=False, soft_wrap=True
        )

    def print(self, lines: Iterable[Line]) -> None:
        for line in lines:
            if self.as_json:
                self.out.write(line.raw + "\n")
            else:
                self.console.print(render(line))
        self.out.flush()


def scan(logs: Path, filt: Filter, sources: dict[Path, Source]) -> list[Source]:
    """Add the log files that appeared since the last scan; all sources in file-name order."""
    for path in logs.glob("*.jsonl"):
        if path not in sources and filt.wants_file(path):
            sources[path] = Source(path)
    return [sources[path] for path in sorted(sources)]


def merged(sources: list[Source], filt: Filter) -> Iterator[Line]:
    # Each file is already in ts order, so a lazy merge never holds more than a line per file.
    lines = heapq.merge(*(source.lines() for source in sources), key=lambda line: line.ts)
    return (line for line in lines if filt.wants(line))


def unknown_roles(logs: Path, roles: tuple[str, ...], *, follow: bool) -> list[str]:
    """The `--role` values that name no log file in `logs` (by role-rank or by kind); when
    following, a role kind a run may still start is not unknown."""
    there = {p.stem for p in logs.glob("*.jsonl")} if logs.is_dir() else set()
    known = there | {name.rsplit("-", 1)[0] for name in there}
    if follow:
        known |= ROLE_KINDS
    return [r for r in roles if r not in known and not (follow and r.rsplit("-", 1)[0] in ROLE_KINDS)]


def _role_kinds() -> frozenset[str]:
    from runtime.config import PlacementEntry

    hint = typing.get_type_hints(PlacementEntry, include_extras=True)["role"]
    return frozenset({"launcher", *typing.get_args(typing.get_args(hint)[0])})


ROLE_KINDS = _role_kinds()


def run_tail(args: argparse.Namespace, out: TextIO | None = None, stop: threading.Event | None = None) -> int:
    """Print the merged logs of `args.run_dir` to `out` (stdout); see the module docstring."""
    run_dir = Path(args.run_dir)
    logs = run_dir / "logs"
    if args.follow and not run_dir.exists():  # started beside a launch that has not made it yet
        print(f"tandem: waiting for {run_dir} to appear (Ctrl-C to stop)", file=sys.stderr)
    elif not run_dir.is_dir():
        print(f"tandem: error: {run_dir} is not a directory", file=sys.stderr)
        return 2
    if not (args.follow or logs.is_dir()):
        print(f"tandem: error: no logs folder at {logs}", file=sys.stderr)
        return 2
    unknown = unknown_roles(logs, tuple(args.role), follow=args.follow)
    if unknown:
        there = sorted(p.stem for p in logs.glob("*.jsonl")) if logs.is_dir() else []
        print(
            f"tandem: error: --role {', '.join(unknown)}: no such log in {logs}; "
            f"there: {', '.join(there) or 'none yet'} (a role kind, e.g. trainer, takes all its ranks)",
            file=sys.stderr,
        )
        return 2
    printer = Printer(out or sys.stdout, args.json)
    filt = Filter.from_args(args)
    stop = stop or threading.Event()
    sources: dict[Path, Source] = {}
    try:
        while True:
            done = args.follow and launcher_done(run_dir)  # before the read: what it wrote last is printed
            printer.print(merged(scan(logs, filt, sources), filt))
            if done:
                print(f"tandem: the run in {run_dir} has ended; stopped following", file=sys.stderr)
            if not args.follow or done or stop.wait(args.poll):
                return 0
    except KeyboardInterrupt:
        return 0
