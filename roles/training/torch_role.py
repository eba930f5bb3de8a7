"""The base of the roles that run a torch engine (the actor trainer and the critic).

Invariant: all of the role's torch work (building the engine, loading its checkpoint,
every step, save and export) runs on one dedicated thread, in the order the event loop
submits it. Every rank thus issues its collectives in the same order, and the event loop
keeps serving heartbeats and requests during long steps.

`setup` builds the engine (`build_engine`, on that thread) and, when the launcher chose a
checkpoint to resume from, loads the engine's part of it (`checkpoint_part`, e.g.
`actor` or `critic`). `close` drops the thread's queued work without waiting for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, TypeVarTuple

import torch

from runtime.checkpoint import resume_dir
from runtime.logs import get_logger
from runtime.role import Role


class Engine(Protocol):
    """What `TorchRole` needs of an engine."""

    version: int
    rank: int
    world_size: int
    device: torch.device

    def load(self, directory: Path) -> None: ...


EngineT = TypeVar("EngineT", bound=Engine)
R = TypeVar("R")
Ts = TypeVarTuple("Ts")


class TorchRole(Role, Generic[EngineT]):
    """Subclasses set `checkpoint_part`, implement `build_engine`, and call `_in_thread`
    for every use of `self.engine`; `setup` / `close` overrides call the base's."""

    checkpoint_part: ClassVar[str]
    engine: EngineT

    def build_engine(self) -> EngineT:
        """The role's engine; runs on the torch thread."""
        raise NotImplementedError

    def resumed(self) -> None:
        """Called on the event loop right after the engine loaded its checkpoint."""

    def ready_fields(self) -> dict[str, Any]:
        """Fields of the `engine_ready` log event."""
        return {"world_size": self.engine.world_size, "device": str(self.engine.device)}

    async def setup(self) -> None:
        log = get_logger(self.kind)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        started = time.perf_counter()
        self.engine = await self._in_thread(self.build_engine)
        resume = resume_dir()
        if resume is not None:
            await self._in_thread(self.engine.load, resume / self.checkpoint_part)
            self.resumed()
            log.info("resumed", checkpoint=str(resume), version=self.engine.version)
        log.info("engine_ready", **self.ready_fields(), seconds=round(time.perf_counter() - started, 2))

    async def _in_thread(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """`fn(*args)` on the torch thread, after everything submitted before it."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def close(self) -> None:
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False, cancel_futures=True)
