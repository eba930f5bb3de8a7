"""The base of the roles that run a torch engine (the actor trainer and the critic).

Invariant: all of the role's torch work (building the engine, loading its checkpoint,
every step, save and export) runs on one dedicated thread, in the order the event loop
submits it. Every rank thus issues its collectives in the same order, and the event loop
keeps serving heartbeats and requests during long steps.

`setup` builds the engine (`build_engine`, on that thread) once every rollout that shares
the role's GPU has started its vLLM engine (runtime/launch/start_order.py) and, when the launcher chose a
checkpoint to resume from, loads the engine's part of it (`checkpoint_part`, e.g.
`actor` or `critic`). `close` drops the thread's queued work without waiting for it.
Work submitted through `_torch` that runs out of GPU memory ends the role with a cause
that names it, the phase and the memory (`out_of_memory`), never a hang or a success.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Generic, TypeVar, TypeVarTuple

import torch

from roles.training.train_engine import TrainEngine
from runtime.checkpoints.checkpoint import resume_dir
from runtime.launch.start_order import colocated_rollouts, wait_for_engines
from runtime.logs import get_logger
from runtime.memory.gpu import GB, out_of_memory_cause
from runtime.role import FatalError, Role

EngineT = TypeVar("EngineT", bound=TrainEngine)
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
        await self._after_colocated_rollouts()
        self.engine = await self._torch("building the engine", self.build_engine)
        resume = resume_dir()
        if resume is not None:
            await self._torch("loading the checkpoint", self.engine.load, resume / self.checkpoint_part)
            self.resumed()
            log.info("resumed", checkpoint=str(resume), version=self.engine.version)
        log.info("engine_ready", **self.ready_fields(), seconds=round(time.perf_counter() - started, 2))

    async def _after_colocated_rollouts(self) -> None:
        """Wait for the rollouts on this rank's GPU to start: vLLM sizes its KV cache from the
        free memory it measures while starting, which a build beside it would shrink."""
        names = colocated_rollouts(self.cfg, self.kind, self.ctx.rank)
        await wait_for_engines(self.ctx.run_dir, self.ctx.name, self.kind, names, self.cfg.startup_timeout_s)

    async def _in_thread(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """`fn(*args)` on the torch thread, after everything submitted before it."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _torch(self, phase: str, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """`_in_thread`, where running out of GPU memory ends the role (`out_of_memory`)."""
        try:
            return await self._in_thread(fn, *args)
        except torch.OutOfMemoryError as exc:
            raise self.out_of_memory(phase, exc) from None

    def out_of_memory(self, phase: str, exc: BaseException) -> FatalError:
        """End the role with a one-line cause naming it, `phase`, what it asked for and held
        and what the GPU had (runtime/memory/gpu.py); returns the error to raise."""
        gpu = None
        device = getattr(getattr(self, "engine", None), "device", None)
        if device is not None and device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            gpu = (device.index or 0, free / GB, total / GB)
        config = str(self.ctx.run_dir / "config.yaml")
        cause = out_of_memory_cause(self.ctx.name, phase, exc, gpu=gpu, config_path=config)
        self.fail(cause)
        return FatalError(cause)

    async def close(self) -> None:
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False, cancel_futures=True)
