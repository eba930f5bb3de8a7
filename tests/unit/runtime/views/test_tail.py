"""`tandem tail`: merge order, filters, following growing and new files, odd lines."""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

from runtime.views.tail import add_tail_arguments, run_tail


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tail_arguments(parser)
    return parser.parse_args(list(argv))


def record(role: str, rank: int, ts: float, event: str, level: str = "info", **fields: Any) -> str:
    head = {"ts": ts, "time": "t", "level": level, "role": role, "rank": rank, "pid": 1, "event": event}
    return json.dumps(head | fields) + "\n"


def write(run_dir: Path, name: str, *lines: str, mode: str = "a") -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "logs" / name, mode) as f:
        f.write("".join(lines))


def tail(*argv: str) -> list[str]:
    out = io.StringIO()
    assert run_tail(parse(*argv), out) == 0
    return out.getvalue().splitlines()


def events(lines: list[str]) -> list[str]:
    return [line.split()[3] for line in lines]


def three_roles(run_dir: Path) -> None:
    now = time.time()
    write(run_dir, "trainer-0.jsonl", *(record("trainer", 0, now + t, f"t0_{t}") for t in (0.1, 0.4, 0.7)))
    write(run_dir, "trainer-1.jsonl", record("trainer", 1, now + 0.5, "t1_0.5", level="warning", loss=0.5))
    write(run_dir, "rollout-0.jsonl", *(record("rollout", 0, now + t, f"r0_{t}", version=3) for t in (0.2, 0.6)))
    write(run_dir, "rollout-0.out", "not a log\n")


def test_merge_orders_by_ts_across_files(tmp_path: Path) -> None:
    three_roles(tmp_path)
    lines = tail(str(tmp_path))
    labels = [line.split()[1] for line in lines]
    assert labels == ["trainer-0", "rollout-0", "trainer-0", "trainer-1", "rollout-0", "trainer-0"]
    assert "rollout-0 v=3 INFO  r0_0.2" in lines[1]
    assert lines[3].endswith("WARNING t1_0.5 loss=0.5")
    assert all("\x1b[" not in line for line in lines)
    raw = tail(str(tmp_path), "--json")
    assert [json.loads(line)["event"] for line in raw] == ["t0_0.1", "r0_0.2", "t0_0.4", "t1_0.5", "r0_0.6", "t0_0.7"]


def test_role_level_and_grep_filters(tmp_path: Path) -> None:
    three_roles(tmp_path)
    assert {line.split()[1] for line in tail(str(tmp_path), "--role", "trainer")} == {"trainer-0", "trainer-1"}
    assert {line.split()[1] for line in tail(str(tmp_path), "--role", "trainer-1", "--role", "rollout")} == {
        "trainer-1",
        "rollout-0",
    }
    assert events(tail(str(tmp_path), "--level", "warning")) == ["t1_0.5"]
    assert len(tail(str(tmp_path), "--grep", '"version": 3')) == 2
    assert tail(str(tmp_path), "--grep", "T0_") == []


def test_since_drops_old_lines(tmp_path: Path) -> None:
    write(tmp_path, "trainer-0.jsonl", record("trainer", 0, time.time() - 3600, "old"))
    write(tmp_path, "trainer-0.jsonl", record("trainer", 0, time.time(), "new"))
    assert events(tail(str(tmp_path), "--since", "60")) == ["new"]


def test_invalid_json_is_shown_as_is(tmp_path: Path) -> None:
    write(tmp_path, "trainer-0.jsonl", record("trainer", 0, 1.0, "first"), "Traceback {oops\n", "[1, 2]\n")
    lines = tail(str(tmp_path), "--level", "error")
    assert [line.strip() for line in lines] == ["trainer-0 Traceback {oops", "trainer-0 [1, 2]"]


def test_values_stay_on_one_line_and_are_truncated(tmp_path: Path) -> None:
    write(tmp_path, "trainer-0.jsonl", record("trainer", 0, 1.0, "boom", exception="Traceback\n  line 1"))
    write(tmp_path, "trainer-0.jsonl", record("trainer", 0, 2.0, "big", text="x" * 1000))
    first, second = tail(str(tmp_path))
    assert first.endswith('boom exception="Traceback\\n  line 1"')
    assert len(second) < 300 and second.endswith("…")


def test_missing_run_dir_exits_2(tmp_path: Path, capsys: Any) -> None:
    assert run_tail(parse(str(tmp_path / "nope")), io.StringIO()) == 2
    assert run_tail(parse(str(tmp_path)), io.StringIO()) == 2
    assert "no logs folder" in capsys.readouterr().err


def wait_for(out: io.StringIO, wanted: list[str], deadline_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = events(out.getvalue().splitlines())
        if all(event in got for event in wanted):
            return got
        time.sleep(0.01)
    raise AssertionError(f"never saw {wanted} in {out.getvalue()!r}")


def test_follow_sees_appends_new_files_and_completed_lines(tmp_path: Path) -> None:
    tmp_path.joinpath("logs").mkdir()
    out, stop = io.StringIO(), threading.Event()
    thread = threading.Thread(target=run_tail, args=(parse(str(tmp_path), "-f", "--poll", "0.01"), out, stop))
    write(tmp_path, "trainer-0.jsonl", record("trainer", 0, 1.0, "before"))
    thread.start()
    try:
        wait_for(out, ["before"])
        write(tmp_path, "trainer-0.jsonl", record("trainer", 0, 2.0, "appended"))
        write(tmp_path, "rollout-0.jsonl", record("rollout", 0, 3.0, "new_file"))
        wait_for(out, ["appended", "new_file"])
        partial = record("trainer", 0, 4.0, "partial")
        write(tmp_path, "trainer-0.jsonl", partial[:20])
        time.sleep(0.1)
        assert "partial" not in out.getvalue()
        write(tmp_path, "trainer-0.jsonl", partial[20:])
        assert wait_for(out, ["partial"]) == ["before", "appended", "new_file", "partial"]
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_follow_waits_for_logs_folder(tmp_path: Path) -> None:
    out, stop = io.StringIO(), threading.Event()
    thread = threading.Thread(target=run_tail, args=(parse(str(tmp_path), "-f", "--poll", "0.01"), out, stop))
    thread.start()
    try:
        time.sleep(0.05)
        write(tmp_path, "trainer-0.jsonl", record("trainer", 0, 1.0, "late"))
        wait_for(out, ["late"])
    finally:
        stop.set()
        thread.join(timeout=5)


def test_follow_waits_for_a_run_directory_that_does_not_exist_yet(tmp_path: Path, capsys: Any) -> None:
    """`tandem tail -f` started beside a launch exited with `is not a directory`."""
    run = tmp_path / "run"
    out, stop = io.StringIO(), threading.Event()
    thread = threading.Thread(target=run_tail, args=(parse(str(run), "-f", "--poll", "0.01"), out, stop))
    thread.start()
    try:
        time.sleep(0.1)
        assert thread.is_alive(), "it gave up on the directory"
        run.mkdir()
        write(run, "controller-0.jsonl", record("controller", 0, 1.0, "first"))
        wait_for(out, ["first"])
    finally:
        stop.set()
        thread.join(timeout=5)
    assert f"waiting for {run} to appear" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert run_tail(parse(str(tmp_path / "a_file"), "-f"), io.StringIO()) == 2
