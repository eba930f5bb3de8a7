"""runtime/gc_pauses.py: set-up's objects are frozen out of every later collection, and a
long collection is reported."""

from __future__ import annotations

import gc

from runtime import gc_pauses


def test_settle_freezes_what_is_alive_and_collects_the_rest(restore_gc: None) -> None:
    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None

    kept = [object() for _ in range(1000)]
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle nobody holds after the del
    del a, b
    frozen = gc_pauses.settle()
    # settle returns the count when it froze; a frozen object that dies afterwards (freed by
    # another thread of the test process: the whole suite failed this once with 761,915 vs
    # 761,917) leaves the permanent generation, and nothing is frozen in between.
    assert frozen >= len(kept) and frozen - 100 <= gc.get_freeze_count() <= frozen
    assert not any(isinstance(o, Node) for o in gc.get_objects()), "the dead cycle was frozen instead of collected"


def test_a_collection_over_the_threshold_is_logged(restore_gc: None) -> None:
    watcher = gc_pauses.watch(threshold_s=0.0, limit=2)
    for _ in range(3):
        gc.collect()
    assert watcher.logged == 2 and watcher.longest_s > 0.0
    quiet = gc_pauses.watch(threshold_s=60.0)
    gc.collect()
    assert quiet.logged == 0


def _pause(watcher: gc_pauses.PauseWatch, monkeypatch, seconds: float, cpu_s: float) -> None:  # type: ignore[no-untyped-def]
    clock = {"wall": 100.0, "cpu": 10.0}
    monkeypatch.setattr(gc_pauses.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(gc_pauses.time, "thread_time", lambda: clock["cpu"])
    watcher("start", {"generation": 2})
    clock["wall"] += seconds
    clock["cpu"] += cpu_s
    watcher("stop", {"generation": 2, "collected": 0})


def test_an_ordinary_runs_pause_stays_in_the_log_and_a_long_one_warns_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`rollout-0 warning gc_pause ... seconds=0.801 cpu_s=0.333` showed on the console of
    ordinary runs, with nothing for a user to do about it."""
    from structlog.testing import capture_logs

    watcher = gc_pauses.PauseWatch()
    with capture_logs() as logs:
        _pause(watcher, monkeypatch, seconds=0.801, cpu_s=0.333)  # the issue's
        _pause(watcher, monkeypatch, seconds=1.5, cpu_s=1.2)  # the collector walking what it should not
        _pause(watcher, monkeypatch, seconds=1.6, cpu_s=1.3)
    assert [line["log_level"] for line in logs] == ["info", "warning", "info"]
    assert watcher.logged == 3 and watcher.warned == 1
