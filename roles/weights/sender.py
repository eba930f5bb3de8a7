"""Trainer rank 0's side of every weight-sync backend: one version to every rollout.

`WeightSender.push(version, source)` pulls packed buckets from `source` (layout.py) and
delivers each to every target in lockstep, the next bucket being gathered and packed
while the current one travels. How a bucket travels is the backend's (transfers.py):

* `zmq`: the bucket's tensors in a `WeightBucket` message (the rollout stages them while
  it generates; CPU, any host),
* `ipc`: a `WeightBucketMeta` carrying a CUDA IPC handle of the packed GPU buffer (the
  rollout's worker maps it and loads from it: same GPU, no copy),
* `nccl`: a `WeightBucketMeta` answered after a broadcast of the packed buffer over a
  dedicated group per rollout (NCCL from a CUDA trainer, gloo from a CPU one).

Each bucket is acknowledged once loaded (zmq: once staged), the last one with
`WeightsApplied` once the rollout switched versions. Every request is bounded by
`timeout_s`; a rollout that stalls, dies or refuses becomes a `WeightSyncError` naming
it and the phase, is forgotten, and the others carry on (`PushResult.failed`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import torch
import zmq.asyncio

from roles.weights.errors import WeightSyncError
from roles.weights.layout import NUM_BUFFERS, PackedBucket, pack
from transport import wire
from transport.endpoint import ChannelOptions
from transport.rpc import RpcEndpoint
from transport.sockets import connect_dealer


@dataclass
class PushResult:
    version: int
    seconds: float
    num_bytes: int
    applied: dict[str, wire.WeightsApplied]
    failed: dict[str, WeightSyncError]
    phases: dict[str, float] = field(default_factory=dict)  # gather_s, transfer_s, load_s


class BucketSource(Protocol):
    async def next(self) -> PackedBucket | None:
        """The next packed bucket of the version, or None after the last."""


class ListSource:
    """Buckets given as dicts of named tensors (tests, benchmarks), each packed on
    `device` into a new buffer when it is pulled."""

    def __init__(self, buckets: Iterable[dict[str, torch.Tensor]], device: torch.device) -> None:
        self._buckets = list(buckets)
        self._device = device
        self._next = 0

    async def next(self) -> PackedBucket | None:
        i = self._next
        if i >= len(self._buckets):
            return None
        self._next += 1
        slots, flat = pack(self._buckets[i], self._device, i)
        return PackedBucket(i, i == len(self._buckets) - 1, slots, flat, buffer=0, gather_s=0.0)


class ThreadSource:
    """Buckets from a generator that must run on one thread (the trainer's torch thread,
    where the export's collectives run): each `next` runs one step of it there."""

    def __init__(self, buckets: Iterator[PackedBucket], executor: Executor) -> None:
        self._buckets = buckets
        self._executor = executor

    async def next(self) -> PackedBucket | None:
        return await asyncio.get_running_loop().run_in_executor(self._executor, next, self._buckets, None)


class Transfer(Protocol):
    """How one backend moves one bucket to one rollout (transfers.py)."""

    name: str
    window: int  # buckets that may be in flight to one target at once (answered in order)

    async def prepare(self, target: str, ep: RpcEndpoint) -> None:
        """Before the first bucket of a version (nccl: form the group once)."""

    async def send(self, target: str, ep: RpcEndpoint, version: int, bucket: PackedBucket) -> wire.Message:
        """Deliver `bucket`; the rollout's reply (Ack, or WeightsApplied for the last)."""

    async def forget(self, target: str) -> None:
        """The target left (or failed): drop what is kept for it."""

    async def aclose(self) -> None: ...


class WeightSender:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        options: ChannelOptions,
        identity: str,
        timeout_s: float,
        transfer: Transfer,
    ) -> None:
        self.ctx = ctx
        self.options = options
        self.identity = identity
        self.timeout_s = timeout_s
        self.transfer = transfer
        self.targets: dict[str, RpcEndpoint] = {}
        self._connections = 0  # DEALERs made so far: each has its own routing identity

    @property
    def backend(self) -> str:
        return self.transfer.name

    async def set_targets(self, peers: list[wire.PeerInfo], *, keep_others: bool = False) -> list[str]:
        """Connect to new rollouts and (unless `keep_others`) forget the ones not listed;
        returns the names that are new."""
        wanted = {f"{p.role}-{p.rank}": p.address for p in peers}
        for name in list(self.targets):
            if name not in wanted and not keep_others:
                await self._forget(name)
        new = [n for n in wanted if n not in self.targets]
        for name in new:
            # A fresh identity per connection: a rollout's ROUTER (handover off) silently drops
            # a reconnect under the identity of a connection it has not yet seen close, as
            # after a failed target is forgotten and its rollout listed again.
            self._connections += 1
            ep = connect_dealer(
                self.ctx,
                wanted[name],
                name=f"weights:{name}",
                identity=f"{self.identity}.{self._connections}",
                options=self.options,
            )
            ep.start()
            self.targets[name] = ep
        return new

    async def push(self, version: int, source: BucketSource, only: list[str] | None = None) -> PushResult:
        """Send `version` to every target (or `only` those); a target that fails is
        reported in `failed` and forgotten, the others are not held up by it.

        Up to `transfer.window` buckets are in flight to a target at once (the rollout
        answers them in order), and the next bucket is packed while fewer than
        `NUM_BUFFERS` are: a buffer is never repacked before its bucket was answered."""
        start = time.perf_counter()
        live = [n for n in self.targets if only is None or n in only]
        failed: dict[str, WeightSyncError] = {}
        replies: dict[str, wire.Message] = {}
        live = await self._each(live, failed, lambda n: self.transfer.prepare(n, self.targets[n]))
        window = max(1, self.transfer.window)
        inflight: deque[dict[str, asyncio.Future[wire.Message]]] = deque()
        gather_s, num_bytes, deliver_s, busy_since = 0.0, 0, 0.0, 0.0
        pulling: asyncio.Future[PackedBucket | None] = asyncio.ensure_future(source.next())

        async def settle() -> None:
            """Wait for the oldest bucket in flight; forget the targets it failed for."""
            nonlocal live, deliver_s
            sends = inflight.popleft()
            results = await asyncio.gather(*sends.values(), return_exceptions=True)
            for name, res in zip(sends, results, strict=True):
                if name in failed:
                    continue  # an earlier bucket failed for it already
                if isinstance(res, WeightSyncError):
                    failed[name] = res
                elif isinstance(res, BaseException):
                    pulling.cancel()
                    for rest in inflight:
                        for fut in rest.values():
                            fut.cancel()
                    raise res
                else:
                    replies[name] = res
            live = [n for n in live if n not in failed]
            if not inflight:
                deliver_s += time.perf_counter() - busy_since

        while True:
            bucket = await pulling
            if bucket is None:
                break
            gather_s += bucket.gather_s
            num_bytes += bucket.nbytes
            while len(inflight) >= window:
                await settle()
            if not live:
                if not bucket.last:
                    await _drain(source)  # nobody left: let the export finish
                break
            if not inflight:
                busy_since = time.perf_counter()
            inflight.append({n: asyncio.ensure_future(self._send(n, version, bucket)) for n in live})
            if bucket.last:
                break
            while len(inflight) >= NUM_BUFFERS:
                await settle()  # its buffer is the one the next bucket goes into
            pulling = asyncio.ensure_future(source.next())  # gather and pack the next one meanwhile
        while inflight:
            await settle()
        for name in failed:
            await self._forget(name)
        applied = self._applied(version, replies, failed)
        load_s = max((a.load_s for a in applied.values()), default=0.0)
        phases = {"gather_s": gather_s, "transfer_s": max(0.0, deliver_s - load_s), "load_s": load_s}
        return PushResult(version, time.perf_counter() - start, num_bytes, applied, failed, phases)

    def _applied(
        self, version: int, replies: dict[str, wire.Message], failed: dict[str, WeightSyncError]
    ) -> dict[str, wire.WeightsApplied]:
        applied = {}
        for name, reply in replies.items():
            if isinstance(reply, wire.WeightsApplied) and reply.version == version:
                applied[name] = reply
            elif name not in failed:
                failed[name] = WeightSyncError(name, "apply", f"unexpected reply {reply!r}")
        return applied

    async def _send(self, name: str, version: int, bucket: PackedBucket) -> wire.Message:
        ep = self.targets.get(name)
        if ep is None:
            raise WeightSyncError(name, "connect", "no longer a target (left the run)")
        return await self.transfer.send(name, ep, version, bucket)

    async def _each(
        self, names: list[str], failed: dict[str, WeightSyncError], fn: Callable[[str], Awaitable[None]]
    ) -> list[str]:
        """Run `fn` for every name concurrently; the names it succeeded for."""
        results = await asyncio.gather(*[fn(n) for n in names], return_exceptions=True)
        ok = []
        for name, res in zip(names, results, strict=True):
            if isinstance(res, WeightSyncError):
                failed[name] = res
            elif isinstance(res, BaseException):
                raise res
            else:
                ok.append(name)
        return ok

    async def _forget(self, name: str) -> None:
        await self.transfer.forget(name)
        gone = self.targets.pop(name, None)
        if gone is not None:
            await gone.aclose()

    async def aclose(self) -> None:
        for name in list(self.targets):
            await self._forget(name)
        await self.transfer.aclose()


async def _drain(source: BucketSource) -> None:
    """Pull the rest of `source` (its export is a collective every rank finishes)."""
    bucket = await source.next()
    while bucket is not None and not bucket.last:
        bucket = await source.next()
