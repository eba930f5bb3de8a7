"""Independent one-GPU benchmark jobs spread over the GPUs of one machine (`--gpus 0,1`).

A job is a callable taking the environment its launches add (`{"CUDA_VISIBLE_DEVICES": g}`,
or `{}` when no GPUs are given). Without GPUs the jobs run here one after the other. With
them, one thread per GPU takes the next job as soon as its previous one ends, so a short
job never waits behind a long one on another GPU. What a caller may rely on:

* each job runs exactly once, and every launch inside it sees only its GPU (placement's
  `devices` index the GPUs the launcher sees: `devices: [0]` is that GPU);
* the results come back in job order, each with the GPU that ran it (None without GPUs);
* when a job fails, no GPU starts another job; the ones running finish, then the first
  failure is raised.

On one 2x H200 host, two single-GPU async_vs_sync runs side by side gave the same rates as
the same run alone on a 1x H200 (11.2 vs 11.5 samples/s, BENCHMARKS.md), so spreading jobs
does not change their figures there; a comparison (sync against async) still belongs in
one job, on one GPU.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from runtime.config import RunConfig
from runtime.config.placement import entries

T = TypeVar("T")
Job = Callable[[dict[str, str]], T]


def parse_gpus(text: str) -> list[str]:
    """`--gpus 0,1` as ["0", "1"] (argparse's `type`); a repeated or empty entry is refused."""
    gpus = [g.strip() for g in text.split(",")]
    if any(not g for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct GPU indices separated by commas, e.g. 0,1")
    return gpus


def check_one_gpu(cfg: RunConfig, config_name: str) -> None:
    """Spreading jobs over GPUs gives each job one GPU: refuse a config placed on more."""
    used = sorted({d for e in entries(cfg) for d in e.devices})
    if used and used != [0]:
        raise ValueError(
            f"--gpus gives each run one GPU, but {config_name} places roles on GPUs {used}: run it without --gpus"
        )
    trainers = sum(e.count for e in entries(cfg) if e.role in ("trainer", "critic"))
    if cfg.trainer.device == "cuda" and not used and trainers > 1:
        raise ValueError(f"--gpus gives each run one GPU, but {config_name} has {trainers} GPU trainer ranks")


def run_spread(jobs: Sequence[Job[T]], gpus: list[str] | None) -> list[tuple[T, str | None]]:
    """Run every job (see the module docstring); (result, GPU) per job, in job order."""
    if not gpus:
        return [(job({}), None) for job in jobs]
    results: dict[int, tuple[T, str]] = {}
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()
    todo = iter(range(len(jobs)))

    def worker(gpu: str) -> None:
        while True:
            with lock:
                if failures:
                    return
                index = next(todo, None)
            if index is None:
                return
            try:
                result = jobs[index]({"CUDA_VISIBLE_DEVICES": gpu})
            except BaseException as exc:  # SystemExit from a failed launch too
                with lock:
                    failures.append((index, exc))
                return
            with lock:
                results[index] = (result, gpu)

    threads = [threading.Thread(target=worker, args=(g,), name=f"gpu-{g}") for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise min(failures, key=lambda f: f[0])[1]
    return [results[i] for i in range(len(jobs))]
