"""The `zmq` weight-sync backend, trainer side: bucketed named tensors to every rollout.

`push(version, buckets)` sends the buckets to all targets concurrently, each bucket
acknowledged before the next, the last one answered only after the rollout loaded the
version. Every phase is bounded by `timeout_s`; a rollout that stalls, dies or refuses
raises `WeightSyncError` naming the rollout, the phase and the cause.

`WeightPusher` also owns what both backends share (targets, failure bookkeeping); the
`nccl` backend (weight_collective.py) overrides `_deliver` and `_forget`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch
import zmq.asyncio

from transport import wire
from transport.endpoint import ChannelOptions
from transport.rpc import PeerUnreachable, RemoteError, RequestTimeout, RpcEndpoint
from transport.sockets import connect_dealer


class WeightSyncError(RuntimeError):
    def __init__(self, rollout: str, phase: str, cause: str) -> None:
        super().__init__(f"weight sync to {rollout} failed in phase '{phase}': {cause}")
        self.rollout = rollout
        self.phase = phase


@dataclass
class PushResult:
    version: int
    seconds: float
    num_bytes: int
    applied: dict[str, wire.WeightsApplied]
    failed: dict[str, WeightSyncError]


class WeightPusher:
    def __init__(self, ctx: zmq.asyncio.Context, options: ChannelOptions, identity: str, timeout_s: float) -> None:
        self.ctx = ctx
        self.options = options
        self.identity = identity
        self.timeout_s = timeout_s
        self.targets: dict[str, RpcEndpoint] = {}

    async def set_targets(self, peers: list[wire.PeerInfo], *, keep_others: bool = False) -> list[str]:
        """Connect to new rollouts and (unless `keep_others`) forget the ones not listed;
        returns the names that are new."""
        wanted = {f"{p.role}-{p.rank}": p.address for p in peers}
        for name in list(self.targets):
            if name not in wanted and not keep_others:
                await self._forget(name)
        new = [n for n in wanted if n not in self.targets]
        for name in new:
            ep = connect_dealer(
                self.ctx, wanted[name], name=f"weights:{name}", identity=self.identity, options=self.options
            )
            ep.start()
            self.targets[name] = ep
        return new

    async def push(
        self, version: int, buckets: list[dict[str, torch.Tensor]], only: list[str] | None = None
    ) -> PushResult:
        """Push to every target (or `only` those); a target that fails is reported in
        `failed` and forgotten, the others are not held up by it."""
        start = time.perf_counter()
        names = [n for n in self.targets if only is None or n in only]
        results = await self._deliver(version, buckets, names)
        applied, failed = {}, {}
        for name, res in results.items():
            if isinstance(res, WeightSyncError):
                failed[name] = res
                await self._forget(name)  # a Peers update may have dropped it already
            elif isinstance(res, BaseException):
                raise res
            else:
                applied[name] = res
        nbytes = sum(t.numel() * t.element_size() for b in buckets for t in b.values())
        return PushResult(version, time.perf_counter() - start, nbytes, applied, failed)

    async def _deliver(
        self, version: int, buckets: list[dict[str, torch.Tensor]], names: list[str]
    ) -> dict[str, wire.WeightsApplied | BaseException]:
        """Send `version` to `names`; each one's `WeightsApplied` or the exception it failed with."""
        results = await asyncio.gather(*[self._push_one(n, version, buckets) for n in names], return_exceptions=True)
        return dict(zip(names, results, strict=True))

    async def _forget(self, name: str) -> None:
        gone = self.targets.pop(name, None)
        if gone is not None:
            await gone.aclose()

    async def _push_one(self, name: str, version: int, buckets: list[dict[str, torch.Tensor]]) -> wire.WeightsApplied:
        ep = self.targets.get(name)
        if ep is None:
            raise WeightSyncError(name, "connect", "no longer a target (left the run)")
        reply: wire.Message | None = None
        for i, tensors in enumerate(buckets):
            last = i == len(buckets) - 1
            phase = "apply" if last else f"bucket {i}"
            msg = wire.WeightBucket(version=version, index=i, last=last, tensors=tensors)
            try:
                reply = await ep.request(msg, timeout=self.timeout_s)
            except (RequestTimeout, PeerUnreachable, ConnectionError) as exc:
                raise WeightSyncError(name, phase, str(exc)) from None
            except RemoteError as exc:
                raise WeightSyncError(name, phase, exc.message) from None
        if not isinstance(reply, wire.WeightsApplied) or reply.version != version:
            raise WeightSyncError(name, "apply", f"unexpected reply {reply!r}")
        return reply

    async def aclose(self) -> None:
        for ep in self.targets.values():
            await ep.aclose()
        self.targets.clear()
