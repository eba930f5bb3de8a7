"""benchmarks/gpu_slots.py: jobs spread over GPUs run side by side, each once, each seeing
its own GPU, results in job order; a failure stops new jobs and is raised."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from benchmarks.gpu_slots import check_one_gpu, parse_gpus, run_spread
from runtime.config.load import load_config


def test_without_gpus_jobs_run_here_in_order() -> None:
    seen: list[tuple[int, dict[str, str]]] = []
    jobs = [lambda env, i=i: seen.append((i, env)) or i * 10 for i in range(3)]
    assert run_spread(jobs, None) == [(0, None), (10, None), (20, None)]
    assert seen == [(0, {}), (1, {}), (2, {})]


def test_jobs_run_side_by_side_each_once_on_its_gpu() -> None:
    both_running = threading.Barrier(2, timeout=10)  # breaks unless two jobs run at once
    ran: list[tuple[int, str]] = []
    lock = threading.Lock()

    def job(i: int, env: dict[str, str]) -> str:
        if i < 2:
            both_running.wait()
        with lock:
            ran.append((i, env["CUDA_VISIBLE_DEVICES"]))
        time.sleep(0.01 * (5 - i))
        return f"r{i}"

    out = run_spread([lambda env, i=i: job(i, env) for i in range(5)], ["0", "3"])
    assert [r for r, _ in out] == ["r0", "r1", "r2", "r3", "r4"]  # job order, whatever finished first
    assert sorted(i for i, _ in ran) == [0, 1, 2, 3, 4]
    assert {gpu for _, gpu in out} == {"0", "3"}
    assert all(gpu == dict(ran)[i] for i, (_, gpu) in enumerate(out))  # the GPU that ran it


def test_a_failure_stops_new_jobs_and_is_raised() -> None:
    started: list[int] = []

    def job(i: int) -> int:
        started.append(i)
        if i == 0:
            raise SystemExit("async_vs_sync: run 0 exited 1")
        time.sleep(0.2)
        return i

    with pytest.raises(SystemExit, match="run 0 exited 1"):
        run_spread([lambda env, i=i: job(i) for i in range(6)], ["0", "1"])
    assert len(started) < 6  # the GPU whose job failed took no other


def test_gpu_lists_and_configs_are_checked() -> None:
    assert parse_gpus("0, 1") == ["0", "1"]
    for bad in ("0,,1", "1,1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct GPU indices"):
            parse_gpus(bad)
    check_one_gpu(load_config("configs/bench_1.5b.yaml"), "bench_1.5b.yaml")  # devices [0]
    check_one_gpu(load_config("configs/tiny_cpu.yaml"), "tiny_cpu.yaml")  # no GPU at all
    with pytest.raises(ValueError, match=r"bench_h200x2.yaml places roles on GPUs \[0, 1\]"):
        check_one_gpu(load_config("configs/bench_h200x2.yaml"), "bench_h200x2.yaml")
