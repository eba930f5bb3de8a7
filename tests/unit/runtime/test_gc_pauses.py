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
