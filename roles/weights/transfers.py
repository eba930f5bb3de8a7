"""How one bucket reaches one rollout, per weight-sync backend (see sender.py).

* `ZmqTransfer`: the bucket's tensors as a `WeightBucket` (views of the packed buffer,
  sent as zero-copy frames).
* `IpcTransfer`: a `WeightBucketMeta` with a CUDA IPC handle of the packed GPU buffer.
  Handles are made once per buffer and reused (the buffers are the packer's own).
* `NcclTransfer`: the first time it sends to a rollout, rank 0 forms a `WeightGroup`
  with the rollout's vLLM workers (it hosts the TCPStore and sends `WeightGroupInit`
  while it joins); then each bucket is a `WeightBucketMeta` plus one broadcast of the
  packed buffer on that group, the reply coming once the rollout loaded it.

Phases in errors: `bucket k` (zmq, ipc), `rendezvous`, `bucket k` / `broadcast` (nccl),
`apply` (the last bucket's reply). Blocking group calls run in threads, so the event loop
stays responsive; each is bounded by `timeout_s` plus a small slack.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from roles.weights.errors import WeightSyncError
from roles.weights.group import WeightGroup, describe, host_store
from roles.weights.ipc import share
from roles.weights.layout import PackedBucket, unpack
from transport import wire
from transport.rpc import PeerUnreachable, RemoteError, RequestTimeout, RpcEndpoint

T = TypeVar("T")
SLACK_S = 2.0  # beyond timeout_s, for the peer's own bounded wait to report first
_ZMQ_ERRORS = (RequestTimeout, PeerUnreachable, ConnectionError)


def _phase(bucket: PackedBucket) -> str:
    return "apply" if bucket.last else f"bucket {bucket.index}"


async def _request(name: str, ep: RpcEndpoint, msg: wire.Message, phase: str, timeout_s: float) -> wire.Message:
    try:
        return await ep.request(msg, timeout=timeout_s)
    except _ZMQ_ERRORS as exc:
        raise WeightSyncError(name, phase, str(exc)) from None
    except RemoteError as exc:
        raise WeightSyncError(name, phase, exc.message) from None


class ZmqTransfer:
    name = "zmq"
    window = 2  # the rollout stages bucket k while k + 1 travels

    def __init__(self, timeout_s: float, *, token: str) -> None:
        """`token`: the run's secret, carried by every message (runtime/identity/run_token.py)."""
        self.timeout_s = timeout_s
        self.token = token

    async def prepare(self, target: str, ep: RpcEndpoint) -> None:
        pass

    async def send(self, target: str, ep: RpcEndpoint, version: int, bucket: PackedBucket) -> wire.Message:
        tensors = dict(unpack(bucket.flat, bucket.slots))
        msg = wire.WeightBucket(
            version=version, index=bucket.index, last=bucket.last, tensors=tensors, token=self.token
        )
        return await _request(target, ep, msg, _phase(bucket), self.timeout_s)

    async def forget(self, target: str) -> None:
        pass

    async def aclose(self) -> None:
        pass


class IpcTransfer:
    name = "ipc"
    # The next handle waits at the rollout while it loads the current bucket, so its
    # workers go from one bucket to the next without a round trip to the trainer.
    window = 2

    def __init__(self, timeout_s: float, *, token: str) -> None:
        self.timeout_s = timeout_s
        self.token = token
        self._handles: dict[tuple[int, int], wire.IpcHandle] = {}  # (data_ptr, numel) -> handle

    async def prepare(self, target: str, ep: RpcEndpoint) -> None:
        pass

    async def send(self, target: str, ep: RpcEndpoint, version: int, bucket: PackedBucket) -> wire.Message:
        # The bytes must be complete before the handle leaves: a handle is shared once per
        # buffer (sharing again would chain a new IPC context onto it per update), so its
        # event is long past for every later bucket packed into the same buffer.
        torch.cuda.current_stream(bucket.flat.device).synchronize()
        msg = wire.WeightBucketMeta(
            version=version,
            index=bucket.index,
            last=bucket.last,
            slots=bucket.slots,
            nbytes=bucket.flat.numel(),
            ipc=self._handle(bucket.flat),
            token=self.token,
        )
        return await _request(target, ep, msg, _phase(bucket), self.timeout_s)

    def _handle(self, flat: torch.Tensor) -> wire.IpcHandle:
        key = (flat.data_ptr(), flat.numel())
        if key not in self._handles:
            self._handles[key] = share(flat)
        return self._handles[key]

    async def forget(self, target: str) -> None:
        pass

    async def aclose(self) -> None:
        self._handles.clear()


class NcclTransfer:
    name = "nccl"
    window = 1  # one broadcast at a time on a group: collectives must be issued in order

    def __init__(
        self, timeout_s: float, *, token: str, host: str, device: torch.device, workers_per_rollout: int = 1
    ) -> None:
        """`token`: the run's secret; `host`: the address rollouts reach this process at (store and gloo);
        `device`: where buckets are broadcast from (CUDA: NCCL; CPU: gloo);
        `workers_per_rollout`: vLLM workers of one rollout (its tensor-parallel size)."""
        self.timeout_s = timeout_s
        self.token = token
        self.host = host
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.world_size = 1 + workers_per_rollout
        self.groups: dict[str, WeightGroup] = {}
        self.store: Any = None
        self._epochs = itertools.count()
        self._threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="weight-group")

    async def prepare(self, target: str, ep: RpcEndpoint) -> None:
        if target not in self.groups:
            self.groups[target] = await self._rendezvous(target, ep)

    async def send(self, target: str, ep: RpcEndpoint, version: int, bucket: PackedBucket) -> wire.Message:
        group = self.groups.get(target)
        if group is None:
            raise WeightSyncError(target, "broadcast", "no weight group (left the run)")
        meta = wire.WeightBucketMeta(
            version=version,
            index=bucket.index,
            last=bucket.last,
            slots=bucket.slots,
            nbytes=bucket.flat.numel(),
            token=self.token,
        )
        phase = _phase(bucket)
        reply = asyncio.ensure_future(_request(target, ep, meta, phase, self.timeout_s + SLACK_S))
        sent = asyncio.ensure_future(self._blocking(lambda: group.broadcast(bucket.flat)))
        await asyncio.wait({reply, sent}, return_when=asyncio.FIRST_EXCEPTION)
        if reply.done() and reply.exception() is not None:
            # The rollout refused or failed: abort the group. The broadcast's thread ends when
            # the backend gives up (gloo only at its timeout); nobody waits for it.
            await self.forget(target)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise reply.exception()  # type: ignore[misc]
        if sent.done() and sent.exception() is not None:
            reply.cancel()
            cause = sent.exception()
            assert cause is not None
            raise WeightSyncError(target, "broadcast", f"bucket {bucket.index}: {describe(cause)}") from None
        await sent
        return await reply

    async def _rendezvous(self, name: str, ep: RpcEndpoint) -> WeightGroup:
        """Join the rollout's group while it joins: rank 0 here, its workers on its side."""
        if self.store is None:
            self.store = host_store(self.host, self.timeout_s)
        prefix = f"tandem-weights/{name}/{next(self._epochs)}"
        init = wire.WeightGroupInit(
            host=self.host,
            port=self.store.port,
            prefix=prefix,
            world_size=self.world_size,
            backend=self.backend,
            timeout_s=self.timeout_s,
            token=self.token,
        )
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

    async def forget(self, target: str) -> None:
        """Drop the target's group; it is aborted in a thread (gloo's abort waits for a
        broadcast in progress to time out), so nothing here waits for it."""
        group = self.groups.pop(target, None)
        if group is not None:
            asyncio.get_running_loop().run_in_executor(self._threads, group.close)

    async def aclose(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        self.store = None
        self._threads.shutdown(wait=False, cancel_futures=True)
