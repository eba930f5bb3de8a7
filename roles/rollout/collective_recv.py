"""The rollout side of the `nccl` weight-sync backend: three requests on the weights socket.

* `WeightGroupInit`: every vLLM worker joins the trainer's broadcast group (a worker
  RPC, while generation goes on); answered with `Ack` once joined. The trainer joins
  at the same time, so the answer can only come after both sides are in.
* `WeightCollectivePlan`: refused (`REFUSED`) when older than the current version (or
  while another receive runs); otherwise the receive starts in the background (pause
  with requests kept, the workers receive and load bucket by bucket, switch version,
  resume) and the plan is acknowledged at once, so the trainer starts broadcasting.
* `WeightsSent`: answered with that receive's outcome, `WeightsApplied` (the same reply,
  controller notice and metrics as the zmq path) or `Error`.

At most one receive runs at a time, and versions only go up (the engine checks again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec

from runtime.logs import get_logger
from transport import wire
from transport.collective import describe

from .engine import RolloutEngine, StaleUpdate

log = get_logger("rollout")
SLACK_S = 1.0  # the workers' own bounded wait reports first


class CollectiveReceiver:
    def __init__(
        self,
        engine: RolloutEngine,
        name: str,
        *,
        local_host: str,
        timeout_s: float,
        on_applied: Callable[[wire.WeightsApplied, float], Awaitable[None]],
    ) -> None:
        """`local_host`: the address the trainer reaches this host at (gloo's interface);
        `on_applied(applied, pause_s)`: called after each loaded version."""
        self.engine = engine
        self.name = name
        self.local_host = local_host
        self.timeout_s = timeout_s
        self.on_applied = on_applied
        self.receiving: tuple[int, asyncio.Task[wire.Message]] | None = None

    async def handle(self, msg: wire.Message) -> wire.Message:
        if isinstance(msg, wire.WeightGroupInit):
            return await self._join(msg)
        if isinstance(msg, wire.WeightCollectivePlan):
            return self._start(msg)
        if isinstance(msg, wire.WeightsSent):
            return await self._finish(msg)
        return wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=f"weights socket got {type(msg).__name__}")

    async def _join(self, init: wire.WeightGroupInit) -> wire.Message:
        # The workers may get to the join late (it queues behind other engine calls): past
        # the trainer's window they fail at once instead of holding the engine for nothing.
        deadline = time.time() + init.timeout_s
        spec = {"init": msgspec.to_builtins(init), "local_host": self.local_host, "deadline": deadline}
        started = time.perf_counter()
        try:
            joined = await self.engine.init_weight_group(spec, init.timeout_s + SLACK_S)
        except Exception as exc:
            cause = describe(exc)
            log.warning("weight_group_failed", prefix=init.prefix, error=cause)
            return wire.Error(code=wire.ErrorCode.UNAVAILABLE, message=f"joining weight group failed: {cause}")
        ranks = sorted(r["rank"] for r in joined)
        seconds = round(time.perf_counter() - started, 3)
        log.info("weight_group_joined", prefix=init.prefix, backend=init.backend, ranks=ranks, seconds=seconds)
        return wire.Ack(info=f"joined as ranks {ranks}")

    def _start(self, plan: wire.WeightCollectivePlan) -> wire.Message:
        if plan.version < self.engine.version:
            reason = f"update to version {plan.version} refused: rollout is at version {self.engine.version}"
            log.warning("update_refused", reason=reason)
            return wire.Error(code=wire.ErrorCode.REFUSED, message=reason)
        if self.receiving is not None and not self.receiving[1].done():
            reason = f"update to version {plan.version} refused: version {self.receiving[0]} is still being received"
            return wire.Error(code=wire.ErrorCode.REFUSED, message=reason)
        task = asyncio.create_task(self._receive(plan), name=f"receive-v{plan.version}")
        self.receiving = (plan.version, task)
        log.info("collective_update_started", update=plan.version, buckets=len(plan.bucket_sizes))
        return wire.Ack()

    async def _receive(self, plan: wire.WeightCollectivePlan) -> wire.Message:
        started = time.perf_counter()
        try:
            times = await self.engine.receive_weights(plan, self.timeout_s)
        except Exception as exc:
            cause = describe(exc)
            log.error("collective_update_failed", update=plan.version, error=cause)
            await self._leave()
            code = wire.ErrorCode.REFUSED if isinstance(exc, StaleUpdate) else wire.ErrorCode.INTERNAL
            return wire.Error(code=code, message=f"receiving version {plan.version}: {cause}")
        applied = wire.WeightsApplied(
            version=plan.version,
            receive_s=times["receive_s"],
            load_s=times["load_s"],
            total_s=time.perf_counter() - started,
            num_tensors=len(plan.slots),
            num_bytes=sum(s.nbytes for s in plan.slots),
            rollout=self.name,
        )
        await self.on_applied(applied, times["pause_s"])
        return applied

    async def _leave(self) -> None:
        """Best effort: leave the group, so a trainer still broadcasting fails at once
        instead of at its timeout (a worker that failed has left already)."""
        try:
            await self.engine.close_weight_group(min(self.timeout_s, 5.0))
        except Exception as exc:
            log.warning("weight_group_close_failed", error=describe(exc))

    async def _finish(self, sent: wire.WeightsSent) -> wire.Message:
        if self.receiving is None or self.receiving[0] != sent.version:
            return wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=f"no update to version {sent.version} begun")
        task = self.receiving[1]
        return await task

    def close(self) -> None:
        if self.receiving is not None:
            self.receiving[1].cancel()
