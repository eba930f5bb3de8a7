"""The `nccl` weight-sync backend, trainer side: broadcast over a dedicated group per rollout.

Rank 0 forms one `WeightGroup` with each rollout's vLLM workers the first time it pushes
to it (the rendezvous: it hosts the TCPStore and sends `WeightGroupInit` over the zmq
weights channel while it joins itself). An update is then, per rollout, a
`WeightCollectivePlan` (acknowledged once the rollout receives), one broadcast per
bucket, and `WeightsSent`, answered by `WeightsApplied` once the rollout loaded it.
Buckets are packed once and broadcast to every rollout in lockstep; the next bucket is
packed while the current one travels.

Every phase ("rendezvous", "plan", "broadcast", "load") is bounded by `timeout_s`; a
stalled, dead or refusing rollout raises `WeightSyncError` naming it and the phase, its
group is aborted and dropped, and the other rollouts carry on (as in the zmq backend).
Blocking group calls run in threads, so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import zmq.asyncio

from roles.trainer.weight_push import WeightPusher, WeightSyncError
from transport import wire
from transport.collective import WeightGroup, bucket_slots, describe, host_store, pack, plan_slots
from transport.endpoint import ChannelOptions
from transport.rpc import PeerUnreachable, RemoteError, RequestTimeout, RpcEndpoint

T = TypeVar("T")
SLACK_S = 2.0  # beyond timeout_s, for the peer's own bounded wait to report first
_ZMQ_ERRORS = (RequestTimeout, PeerUnreachable, ConnectionError)


class CollectivePusher(WeightPusher):
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        options: ChannelOptions,
        identity: str,
        timeout_s: float,
        *,
        host: str,
        device: torch.device,
        workers_per_rollout: int = 1,
    ) -> None:
        """`host`: the address rollouts reach this process at (store and gloo);
        `device`: where buckets are broadcast from (CUDA: NCCL; CPU: gloo);
        `workers_per_rollout`: vLLM workers of one rollout (its tensor-parallel size)."""
        super().__init__(ctx, options, identity, timeout_s)
        self.host = host
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.world_size = 1 + workers_per_rollout
        self.groups: dict[str, WeightGroup] = {}
        self.store: Any = None
        self._epochs = itertools.count()
        self._threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="weight-group")

    async def _deliver(
        self, version: int, buckets: list[dict[str, torch.Tensor]], names: list[str]
    ) -> dict[str, wire.WeightsApplied | BaseException]:
        slots, sizes = plan_slots(buckets)
        plan = wire.WeightCollectivePlan(version=version, slots=slots, bucket_sizes=sizes)
        packing = self._pack(buckets, slots, sizes, 0) if names and buckets else None  # during the plans
        live, failed = await _each(names, lambda n: self._begin(n, plan))
        for i in range(len(buckets) if live else 0):
            assert packing is not None
            flat = await packing
            packing = self._pack(buckets, slots, sizes, i + 1) if i + 1 < len(buckets) else None
            live, more = await _each(list(live), lambda n, flat=flat, i=i: self._broadcast(n, flat, i))
            failed.update(more)
            if not live:  # nobody left to send to
                break
        if packing is not None:
            await packing  # nobody left to send it to: let the thread finish
        applied, more = await _each(list(live), lambda n: self._finish(n, version))
        return {**failed, **more, **applied}

    def _pack(self, buckets: list[dict[str, torch.Tensor]], slots: list[Any], sizes: list[int], i: int) -> Any:
        fut = asyncio.get_running_loop().run_in_executor(
            self._threads, pack, buckets[i], bucket_slots(slots, i), sizes[i], self.device
        )
        return asyncio.ensure_future(fut)

    async def _begin(self, name: str, plan: wire.WeightCollectivePlan) -> None:
        """Rendezvous (first time only), then the plan; returns once the rollout receives."""
        ep = self.targets.get(name)
        if ep is None:
            raise WeightSyncError(name, "connect", "no longer a target (left the run)")
        if name not in self.groups:
            self.groups[name] = await self._rendezvous(name, ep)
        try:
            await ep.request(plan, timeout=self.timeout_s)
        except _ZMQ_ERRORS as exc:
            raise WeightSyncError(name, "plan", str(exc)) from None
        except RemoteError as exc:
            raise WeightSyncError(name, "plan", exc.message) from None

    async def _rendezvous(self, name: str, ep: RpcEndpoint) -> WeightGroup:
        """Join the rollout's group while it joins: rank 0 here, its workers on its side."""
        if self.store is None:
            self.store = host_store(self.host, self.timeout_s)
        prefix = f"tandem-weights/{name}/{next(self._epochs)}"
        init = wire.WeightGroupInit(
            host=self.host, port=self.store.port, prefix=prefix, world_size=self.world_size,
            backend=self.backend, timeout_s=self.timeout_s,
        )  # fmt: skip
        store, world, device, timeout_s, host = self.store, self.world_size, self.device, self.timeout_s, self.host
        join = asyncio.ensure_future(
            self._blocking(
                lambda: WeightGroup.join(store, prefix, 0, world, device, timeout_s, host), on_late=WeightGroup.close
            )
        )
        ask = asyncio.ensure_future(ep.request(init, timeout=self.timeout_s + SLACK_S))
        try:
            group, _ = await asyncio.gather(join, ask)
        except BaseException as exc:
            join.cancel()  # a group formed after all is closed (on_late)
            ask.cancel()
            if isinstance(exc, RemoteError):
                raise WeightSyncError(name, "rendezvous", exc.message) from None
            if isinstance(exc, (*_ZMQ_ERRORS, RuntimeError, TimeoutError)):
                raise WeightSyncError(name, "rendezvous", describe(exc)) from None
            raise
        return group  # type: ignore[no-any-return]

    async def _broadcast(self, name: str, flat: torch.Tensor, index: int) -> None:
        group = self.groups.get(name)
        if group is None:
            raise WeightSyncError(name, "broadcast", "no longer a target (left the run)")
        try:
            await self._blocking(lambda: group.broadcast(flat))
        except (RuntimeError, TimeoutError) as exc:
            raise WeightSyncError(name, "broadcast", f"bucket {index}: {describe(exc)}") from None

    async def _finish(self, name: str, version: int) -> wire.WeightsApplied:
        ep = self.targets.get(name)
        if ep is None:
            raise WeightSyncError(name, "load", "no longer a target (left the run)")
        try:
            reply = await ep.request(wire.WeightsSent(version=version), timeout=self.timeout_s)
        except _ZMQ_ERRORS as exc:
            raise WeightSyncError(name, "load", str(exc)) from None
        except RemoteError as exc:
            raise WeightSyncError(name, "load", exc.message) from None
        if not isinstance(reply, wire.WeightsApplied) or reply.version != version:
            raise WeightSyncError(name, "load", f"unexpected reply {reply!r}")
        return reply

    async def _blocking(self, fn: Callable[[], T], on_late: Callable[[T], Any] | None = None) -> T:
        """Run a blocking group call in a thread, bounded by timeout_s (+ slack). A result
        that arrives after we gave up is passed to `on_late` (to close it)."""
        fut = asyncio.get_running_loop().run_in_executor(self._threads, fn)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s + SLACK_S)
        except BaseException:
            if on_late is not None:
                fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else on_late(f.result()))
            raise

    async def _forget(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            group.close()
        await super()._forget(name)

    async def aclose(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        self.store = None
        await super().aclose()
        self._threads.shutdown(wait=False, cancel_futures=True)


async def _each(names: list[str], fn: Callable[[str], Awaitable[T]]) -> tuple[dict[str, T], dict[str, BaseException]]:
    """Run `fn` for every name concurrently; results and exceptions by name."""
    results = await asyncio.gather(*[fn(n) for n in names], return_exceptions=True)
    ok = {n: r for n, r in zip(names, results, strict=True) if not isinstance(r, BaseException)}
    failed = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)}
    return ok, failed  # type: ignore[return-value]
