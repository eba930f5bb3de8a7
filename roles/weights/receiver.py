"""A rollout's side of every weight-sync backend: the requests on its weights socket.

* `WeightBucket` (zmq): buckets are staged in shared memory while generation goes on;
  the last one is answered once the version is loaded (pause with requests kept, load,
  switch version, resume): `WeightsApplied`.
* `WeightGroupInit` (nccl): every vLLM worker joins the trainer's broadcast group (a
  worker RPC, while generation goes on); `Ack` once joined.
* `WeightChecksums`: answered with every vLLM parameter's sum at the current version.
* `WeightBucketMeta` (ipc, nccl): bucket 0 opens an update (pause with requests kept);
  each bucket is loaded by the workers — from the CUDA IPC handle it carries, or from the
  broadcast the trainer sends beside it — and answered by `Ack`; the last one switches
  the version, resumes and is answered by `WeightsApplied`. An update whose next bucket
  does not come within `timeout_s` (a trainer that died mid-update) is abandoned:
  generation resumes on the old version (layers loaded before keep the new weights).

Weight messages (checksum requests too) without the run's secret (runtime/identity/run_token.py)
are refused (`REFUSED`) and counted in `refused`, before anything else. An update is
refused (`Error(REFUSED)`) before any work unless its version is the rollout's own (a
re-send) or the next one: the trainer publishes every version to every live rollout. The
one exception is the sync of a rollout that registered behind the trainer (a late joiner,
or one resumed without weights: `expect_sync`), whose first update may jump to the
trainer's version or beyond. No update is ever taken above the last version the run can
make (`max_version`, the run's `trainer.total_steps`). Buckets out of order are refused
(`BAD_REQUEST`). One update is open at a time: a new bucket 0 abandons an open one. An
update with a NaN or infinite weight is refused where its bytes land (the worker
extension checks each staged version or bucket before loading it): `Error(REFUSED)`
naming the tensor, the update abandoned, the rollout left on its version.
`on_applied(applied, pause_s)` runs after each loaded version (all backends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from roles.weights.errors import StaleUpdate
from roles.weights.group import describe
from roles.weights.staging import WeightStager
from roles.weights.worker_calls import WorkerCall
from runtime.identity.run_token import matches
from runtime.logs import get_logger
from transport import wire
from transport.throttle import Throttled

log = get_logger("rollout")
SLACK_S = 1.0  # the workers' own bounded wait reports first
NONFINITE = "weights refused: not finite"  # the worker extension's refusal (worker_ext.refuse_nonfinite)


class UpdatableEngine(Protocol):
    """What the receiver needs of the rollout's engine (roles/generation/engine.py)."""

    version: int

    @property
    def updating(self) -> int | None: ...
    async def begin_update(self, version: int, timeout_s: float) -> float: ...
    async def load_bucket(self, method: WorkerCall, spec: Any, timeout_s: float) -> dict[str, float]: ...
    async def finish_update(self, timeout_s: float) -> None: ...
    async def abandon_update(self, timeout_s: float) -> None: ...
    async def apply_weights(self, version: int, manifest: dict[str, Any], timeout_s: float) -> dict[str, float]: ...
    async def init_weight_group(self, spec: dict[str, Any], timeout_s: float) -> list[Any]: ...
    async def close_weight_group(self, timeout_s: float) -> None: ...
    async def checksums(self) -> dict[str, float]: ...


@dataclass
class _Update:
    version: int
    backend: str
    started: float
    pause_s: float = 0.0
    receive_s: float = 0.0
    load_s: float = 0.0
    next_index: int = 0
    num_tensors: int = 0
    num_bytes: int = 0
    engine_s: list[float] = field(default_factory=list)  # each bucket's engine call (load RPC)
    gaps_s: list[float] = field(default_factory=list)  # from a bucket's reply to the next bucket's arrival
    replied: float = 0.0


class WeightReceiver:
    def __init__(
        self,
        engine: UpdatableEngine,
        name: str,
        *,
        local_host: str,
        timeout_s: float,
        token: str,
        on_applied: Callable[[wire.WeightsApplied, float], Awaitable[None]],
        on_failure: Callable[[BaseException], Awaitable[str | None]] | None = None,
        max_version: int | None = None,
    ) -> None:
        """`local_host`: the address the trainer reaches this host at (gloo's interface);
        `token`: the run's secret, which every weight message must carry; `on_failure`:
        told of every failed update before the reply; a cause it returns (the rollout is
        ending: a dead engine) is the reply's message; `max_version`: no update above it is
        taken (None: no bound, for tests of the receiver alone)."""
        self.engine = engine
        self.max_version = max_version
        self.token = token
        self.refused = 0
        self.noisy = Throttled(log)
        self.name = name
        self.local_host = local_host
        self.timeout_s = timeout_s
        self.on_applied = on_applied
        self.on_failure = on_failure
        self.stager = WeightStager(name)
        self.update: _Update | None = None
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task[None] | None = None
        self._sync_floor: int | None = None  # a pending sync's least version (expect_sync)

    def expect_sync(self, trainer_version: int) -> None:
        """Registration said the trainer is at `trainer_version`: a rollout behind it will be
        synced there, so its next update may jump to that version or beyond (once)."""
        self._sync_floor = trainer_version if trainer_version > self.engine.version else None

    async def handle(self, msg: wire.Message) -> wire.Message:
        weights = wire.WeightBucket | wire.WeightBucketMeta | wire.WeightGroupInit | wire.WeightChecksums
        if isinstance(msg, weights) and not matches(msg.token, self.token):
            self.refused += 1
            self.noisy.warning("weights_refused", reason="no valid run token", update=msg_version(msg))
            return wire.Error(code=wire.ErrorCode.REFUSED, message="weights refused: no valid run token")
        if isinstance(msg, wire.WeightGroupInit):
            return await self._join(msg)  # not under the lock: the join runs while updates may go on
        async with self._lock:
            if isinstance(msg, wire.WeightBucket):
                return await self._staged(msg)
            if isinstance(msg, wire.WeightBucketMeta):
                return await self._bucket(msg)
            if isinstance(msg, wire.WeightChecksums):
                return wire.WeightChecksums(version=self.engine.version, sums=await self.engine.checksums())
        return wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=f"weights socket got {type(msg).__name__}")

    # --- zmq: stage, then load -------------------------------------------------------
    async def _staged(self, msg: wire.WeightBucket) -> wire.Message:
        if (why := self._refusal(msg.version)) is not None:
            return self._refuse(why)
        try:
            self.stager.add(msg)
        except ValueError as exc:
            return wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=str(exc))
        if not msg.last:
            return wire.Ack()
        receive_s = time.perf_counter() - self.stager.started
        manifest, nbytes = self.stager.manifest(), self.stager.num_bytes
        log.info("weight_update_started", update=msg.version, backend="zmq")
        try:
            times = await self.engine.apply_weights(msg.version, manifest, self.timeout_s)
        except StaleUpdate as exc:
            return wire.Error(code=wire.ErrorCode.REFUSED, message=str(exc))
        except Exception as exc:
            return await self._fail(msg.version, exc)
        finally:
            self.stager.discard()
        applied = wire.WeightsApplied(
            version=msg.version,
            receive_s=receive_s,
            load_s=times["load_s"],
            total_s=receive_s + times["total_s"],
            num_tensors=len(manifest["entries"]),
            num_bytes=nbytes,
            rollout=self.name,
        )
        await self._applied(applied, times["pause_s"])
        return applied

    # --- ipc / nccl: bucket by bucket ---------------------------------------------------
    async def _bucket(self, meta: wire.WeightBucketMeta) -> wire.Message:
        backend = "nccl" if meta.ipc is None else "ipc"
        arrived = time.perf_counter()
        self._stop_watchdog()
        update = self.update
        if meta.index == 0:
            if (why := self._refusal(meta.version)) is not None:
                return self._refuse(why)
            if update is not None:
                await self._abandon(f"a new update to version {meta.version} began")
            try:
                update = await self._begin(meta.version, backend)
            except StaleUpdate as exc:
                return wire.Error(code=wire.ErrorCode.REFUSED, message=str(exc))
            except Exception as exc:
                return await self._fail(meta.version, exc)
        elif update is None or update.version != meta.version or update.next_index != meta.index:
            expected = f"bucket {update.next_index} of version {update.version}" if update else "bucket 0"
            return wire.Error(
                code=wire.ErrorCode.BAD_REQUEST,
                message=f"weight bucket {meta.index} of version {meta.version} out of order (expected {expected})",
            )
        spec = {"slots": msgspec.to_builtins(meta.slots), "nbytes": meta.nbytes}
        if meta.ipc is not None:
            spec["ipc"] = msgspec.to_builtins(meta.ipc)
        method = WorkerCall.RECEIVE_BUCKET if meta.ipc is None else WorkerCall.LOAD_IPC
        if meta.index > 0:
            update.gaps_s.append(arrived - update.replied)
        called = time.perf_counter()
        try:
            times = await self.engine.load_bucket(method, spec, self.timeout_s + SLACK_S)
        except Exception as exc:
            if meta.ipc is None:
                await self._leave_group()
            return await self._fail(meta.version, exc)
        update.engine_s.append(time.perf_counter() - called)
        update.receive_s += times["receive_s"]
        update.load_s += times["load_s"]
        update.num_tensors += len(meta.slots)
        update.num_bytes += sum(s.nbytes for s in meta.slots)
        update.next_index += 1
        if meta.last:
            try:
                return await self._finish(update)
            except Exception as exc:
                return await self._fail(meta.version, exc)
        self._watchdog = asyncio.create_task(self._expire(update), name=f"weights-v{update.version}-watchdog")
        update.replied = time.perf_counter()
        return wire.Ack()

    # --- the update's life ---------------------------------------------------------------
    async def _begin(self, version: int, backend: str) -> _Update:
        started = time.perf_counter()
        log.info("weight_update_started", update=version, backend=backend)
        pause_s = await self.engine.begin_update(version, self.timeout_s)
        self.update = _Update(version=version, backend=backend, started=started, pause_s=pause_s)
        return self.update

    async def _finish(self, update: _Update) -> wire.WeightsApplied:
        finishing = time.perf_counter()
        await self.engine.finish_update(self.timeout_s)
        self.update = None
        # Where an update's time went, rollout side: the pause, each bucket's engine call
        # (its worker's own load_s inside), the waits for the trainer's next bucket, the finish.
        log.info(
            "weight_update_timing",
            update=update.version,
            backend=update.backend,
            buckets=update.next_index,
            pause_s=round(update.pause_s, 4),
            engine_s=[round(t, 4) for t in update.engine_s],
            gaps_s=[round(t, 4) for t in update.gaps_s],
            finish_s=round(time.perf_counter() - finishing, 4),
        )
        applied = wire.WeightsApplied(
            version=update.version,
            receive_s=update.receive_s,
            load_s=update.load_s,
            total_s=time.perf_counter() - update.started,
            num_tensors=update.num_tensors,
            num_bytes=update.num_bytes,
            rollout=self.name,
        )
        await self._applied(applied, update.pause_s)
        return applied

    async def _applied(self, applied: wire.WeightsApplied, pause_s: float) -> None:
        self._sync_floor = None  # synced: from here on, only the next version
        await self.on_applied(applied, pause_s)

    async def _fail(self, version: int, exc: BaseException) -> wire.Message:
        cause = describe(exc)
        if NONFINITE in cause:  # the sender's fault, not the engine's: refused, the update abandoned
            self.noisy.warning("weight_update_refused", update=version, reason=cause)
            await self._abandon(cause)
            return wire.Error(code=wire.ErrorCode.REFUSED, message=f"update to version {version}: {cause}")
        log.error("weight_update_failed", update=version, error=cause)
        fatal = await self.on_failure(exc) if self.on_failure is not None else None
        if fatal:  # the engine is gone: nothing to resume
            self.update = None
            return wire.Error(code=wire.ErrorCode.INTERNAL, message=f"loading version {version}: {fatal}")
        await self._abandon(cause)
        if isinstance(exc, StaleUpdate):
            return wire.Error(code=wire.ErrorCode.REFUSED, message=str(exc))
        return wire.Error(code=wire.ErrorCode.INTERNAL, message=f"loading version {version}: {cause}")

    async def _abandon(self, why: str) -> None:
        update, self.update = self.update, None
        if update is None and self.engine.updating is None:
            return
        log.warning("weight_update_abandoned", update=update.version if update else None, reason=why)
        try:
            await self.engine.abandon_update(self.timeout_s)
        except Exception as exc:
            log.error("weight_update_abandon_failed", error=describe(exc))

    async def _expire(self, update: _Update) -> None:
        await asyncio.sleep(self.timeout_s)
        async with self._lock:
            if self.update is update:
                await self._abandon(f"no bucket {update.next_index} within {self.timeout_s:g}s")

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None and not self._watchdog.done():
            self._watchdog.cancel()
        self._watchdog = None

    def _refusal(self, version: int) -> str | None:
        """Why an update to `version` is refused (see module docs), or None when it is taken."""
        current = self.engine.version
        reason = f"update to version {version} refused: rollout is at version {current}"
        if self.max_version is not None and version > self.max_version:
            return f"{reason}, the run's last is {self.max_version}"
        syncing = self._sync_floor is not None and version >= self._sync_floor
        if version > current + 1 and not syncing:
            return f"{reason} and takes only {current + 1} next"
        return reason if version < current else None

    def _refuse(self, reason: str) -> wire.Message:
        self.noisy.warning("update_refused", reason=reason)
        return wire.Error(code=wire.ErrorCode.REFUSED, message=reason)

    # --- nccl: the group -------------------------------------------------------------
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

    async def _leave_group(self) -> None:
        """Best effort: leave the group, so a trainer still broadcasting fails at once
        instead of at its timeout (a worker that failed has left already)."""
        try:
            await self.engine.close_weight_group(min(self.timeout_s, 5.0))
        except Exception as exc:
            log.warning("weight_group_close_failed", error=describe(exc))

    def close(self) -> None:
        self._stop_watchdog()
        self.stager.discard()


def msg_version(msg: wire.Message) -> int | None:
    return getattr(msg, "version", None)
