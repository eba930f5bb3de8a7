"""Who builds first on a shared GPU.

vLLM sizes its KV cache at start-up from a profiling run that reads the GPU's free
memory; a trainer or critic rank that builds its model on the same GPU meanwhile shrinks
that figure under it, and the engine fails to start ("Engine core initialization
failed"; seen with the 7B recipe on one H200). So a torch role whose GPU a rollout shares
(by `placement`) builds only once each such rollout has started its engine.

Two engines on one GPU count each other's allocations the same way ("No available memory
for the cache blocks"), so a distillation teacher starts its engine only once the rollouts
on its GPU have started theirs (`engines_before`).

A rollout (and a distillation teacher, `ENGINE_ROLES`) marks its start with `mark_started`
(a file under `RUN_DIR/started/`, cleared by the launcher with `clear_started` before any
role starts); `wait_started` waits for the marks of `colocated_rollouts`, bounded by
`startup_timeout_s`. A rollout that dies before its mark brings the run down through the
launcher, as any dead role does.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

from runtime.config import RunConfig
from runtime.config.placement import placed_processes
from runtime.logs import get_logger
from runtime.role import FatalError

POLL_S = 0.25
ENGINE_ROLES = ("rollout", "teacher")  # roles that start a vLLM engine and mark it


def _marks(run_dir: Path) -> Path:
    return run_dir / "started"


def clear_started(run_dir: Path) -> None:
    """Forget every mark of an earlier launch into `run_dir`."""
    shutil.rmtree(_marks(run_dir), ignore_errors=True)


def mark_started(run_dir: Path, name: str) -> None:
    """Record that process `name` (e.g. `rollout-0`) has started its engine."""
    _marks(run_dir).mkdir(parents=True, exist_ok=True)
    (_marks(run_dir) / name).touch()


def colocated_rollouts(cfg: RunConfig, role: str, rank: int) -> list[str]:
    """Names of the rollouts (and distillation teachers, whose vLLM profiles the GPU the
    same way) that `placement` puts on a GPU (same node, same index) of process
    `role`-`rank`; processes placed without `devices` never count."""
    procs = placed_processes(cfg)
    mine = {g for p in procs if p.role == role and p.rank == rank for g in p.gpus}
    return [f"{p.role}-{p.rank}" for p in procs if p.role in ENGINE_ROLES and p.gpus & mine]


def engines_before(cfg: RunConfig, role: str, rank: int) -> list[str]:
    """The rollouts a distillation teacher `role`-`rank` waits for before it starts its own
    engine: two vLLM engines profiling one GPU at once each count the other's allocations as
    their own and one finds no memory for its KV cache. Empty for every other role."""
    if role != "teacher":
        return []
    return [n for n in colocated_rollouts(cfg, role, rank) if n.startswith("rollout-")]


async def wait_started(run_dir: Path, names: list[str], timeout_s: float) -> None:
    """Return once every process in `names` has marked its start; raise `TimeoutError`
    naming those that have not after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [n for n in names if not (_marks(run_dir) / n).exists()]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{', '.join(missing)} did not start its engine within {timeout_s:g} s")
        await asyncio.sleep(POLL_S)


async def wait_for_engines(run_dir: Path, name: str, kind: str, engines: list[str], timeout_s: float) -> None:
    """What process `name` (of role `kind`) does before it builds on a GPU that `engines`
    share: say so in its log, wait for their marks, and end with a `FatalError` naming it
    and the engines that never started. Returns at once for no engines."""
    if not engines:
        return
    get_logger(kind).info("waiting_for_colocated_rollouts", rollouts=engines)
    try:
        await wait_started(run_dir, engines, timeout_s)
    except TimeoutError as exc:
        raise FatalError(f"{name} shares its GPU with a rollout that never started: {exc}") from None
