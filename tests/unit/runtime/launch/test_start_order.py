"""Start order on a shared GPU (runtime/launch/start_order.py): a torch role waits for exactly the
rollouts that placement puts on its GPU, the wait ends when their marks appear and fails
naming the missing ones when they never do, and a new launch forgets old marks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from runtime.config import PlacementEntry, RunConfig
from runtime.config.load import load_config
from runtime.launch.start_order import clear_started, colocated_rollouts, engines_before, mark_started, wait_started


def _cfg(*placement: PlacementEntry) -> RunConfig:
    cfg = load_config(None, [])
    cfg.placement = [PlacementEntry(role="controller"), *placement, PlacementEntry(role="reward")]
    return cfg


def test_the_bench_recipe_trainer_waits_for_its_rollout() -> None:
    cfg = load_config("configs/bench_7b.yaml", [])
    assert colocated_rollouts(cfg, "trainer", 0) == ["rollout-0"]


def test_only_rollouts_on_the_same_gpu_count() -> None:
    cfg = _cfg(
        PlacementEntry(role="rollout", count=2, devices=[0, 1]),
        PlacementEntry(role="trainer", count=2, devices=[1, 2]),
        PlacementEntry(role="critic", count=1, devices=[0]),
    )
    assert colocated_rollouts(cfg, "trainer", 0) == ["rollout-1"]
    assert colocated_rollouts(cfg, "trainer", 1) == []
    assert colocated_rollouts(cfg, "critic", 0) == ["rollout-0"]


def test_cpu_recipe_waits_for_nothing() -> None:
    cfg = load_config("configs/tiny_cpu.yaml", [])
    assert colocated_rollouts(cfg, "trainer", 0) == []


def test_wait_ends_when_the_marks_appear(tmp_path: Path) -> None:
    async def main() -> float:
        async def later() -> None:
            await asyncio.sleep(0.5)
            mark_started(tmp_path, "rollout-0")
            mark_started(tmp_path, "rollout-1")

        t = time.monotonic()
        marker = asyncio.create_task(later())
        await wait_started(tmp_path, ["rollout-0", "rollout-1"], timeout_s=10)
        await marker
        return time.monotonic() - t

    waited = asyncio.run(main())
    assert 0.5 <= waited < 5


def test_wait_names_the_rollout_that_never_started(tmp_path: Path) -> None:
    mark_started(tmp_path, "rollout-0")
    with pytest.raises(TimeoutError, match=r"^rollout-1 did not start its engine within 0.5 s$"):
        asyncio.run(wait_started(tmp_path, ["rollout-0", "rollout-1"], timeout_s=0.5))


def test_a_new_launch_forgets_old_marks(tmp_path: Path) -> None:
    mark_started(tmp_path, "rollout-0")
    clear_started(tmp_path)
    with pytest.raises(TimeoutError, match="rollout-0"):
        asyncio.run(wait_started(tmp_path, ["rollout-0"], timeout_s=0.3))
    clear_started(tmp_path)  # nothing to clear: no error


def test_the_distillation_recipe_trainer_waits_for_the_teacher_too() -> None:
    """The teacher's vLLM profiles the GPU it shares as a rollout's does."""
    cfg = load_config("configs/distill_1.5b.yaml", [])
    assert sorted(colocated_rollouts(cfg, "trainer", 0)) == ["rollout-0", "teacher-0"]
    assert colocated_rollouts(load_config("configs/distill_tiny_cpu.yaml", []), "trainer", 0) == []


def test_a_teacher_starts_its_engine_after_the_rollouts_on_its_gpu() -> None:
    """Two vLLM engines profiling one GPU at once: the one H100 run of the distillation recipe
    failed so ("No available memory for the cache blocks" in the teacher)."""
    cfg = load_config("configs/distill_1.5b.yaml", [])
    assert engines_before(cfg, "teacher", 0) == ["rollout-0"]
    assert engines_before(cfg, "rollout", 0) == []
    assert engines_before(cfg, "trainer", 0) == []
    assert engines_before(load_config("configs/distill_tiny_cpu.yaml", []), "teacher", 0) == []


def test_a_process_waiting_for_an_engine_that_never_starts_ends_naming_both(tmp_path: Path) -> None:
    from runtime.launch.start_order import wait_for_engines
    from runtime.role import FatalError

    asyncio.run(wait_for_engines(tmp_path, "teacher-0", "teacher", [], timeout_s=0.1))  # nothing to wait for
    with pytest.raises(FatalError, match=r"teacher-0 shares its GPU with a rollout that never started: rollout-0"):
        asyncio.run(wait_for_engines(tmp_path, "teacher-0", "teacher", ["rollout-0"], timeout_s=0.3))
