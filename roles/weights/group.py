"""Weight broadcast over a dedicated process group: the `nccl` weight-sync backend's data plane.

A `WeightGroup` joins trainer rank 0 (group rank 0, the only sender) with one rollout's
vLLM workers, and is built from a `TCPStore` and a standalone backend object, so no
default or global process group is created or touched: the trainer's training world
and vLLM's own groups never share a communicator with it. The backend is NCCL when the
group's tensors live on a GPU and gloo on CPU; both run the very same code below except
where `self.cuda` says otherwise (the lines to verify on a GPU).

Every blocking call is bounded by the group's timeout: joining waits at most that long
for the peers, and a broadcast that does not complete in time raises (gloo's own
timeout; for NCCL, whose waits do not block the CPU, a poll against a deadline). Callers
run these calls in a thread and `close()` a group after any failure.

Buckets travel as flat uint8 buffers laid out by roles/weights/layout.py.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

from runtime.launch.rendezvous import listening_socket

_ENV_LOCK = threading.Lock()


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The TCPStore trainer rank 0 serves for its weight groups, on a free port (`.port`)
    of `host` only (by itself a TCPStore listens on every interface)."""
    sock = listening_socket(host)
    port = sock.getsockname()[1]
    return dist.TCPStore(  # the store owns the listening socket from here on
        host, port, is_master=True, wait_for_workers=False, timeout=_delta(timeout_s), master_listen_fd=sock.detach()
    )


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=_delta(timeout_s))


class WeightGroup:
    """A joined broadcast group; rank 0 sends, every other rank receives."""

    def __init__(self, pg: Any, store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> None:
        self.pg: Any = pg
        self.store: dist.Store | None = store
        self.rank = rank
        self.device = device
        self.cuda = device.type == "cuda"
        self.timeout_s = timeout_s

    @classmethod
    def join(
        cls,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        local_host: str,
    ) -> WeightGroup:
        """Form the group (blocks until every rank joined, at most `timeout_s`) and check
        it with one small broadcast, which also creates NCCL's communicator."""
        scoped = dist.PrefixStore(prefix, store)
        if device.type == "cuda":
            pg = _nccl(scoped, rank, world_size, timeout_s)
        else:
            pg = _gloo(scoped, rank, world_size, timeout_s, local_host)
        group = cls(pg, store, rank, device, timeout_s)
        try:
            group._handshake(prefix)
        except BaseException:
            group.close()
            raise
        return group

    def _handshake(self, prefix: str) -> None:
        token = zlib.crc32(prefix.encode())
        t = torch.tensor([token if self.rank == 0 else -1], dtype=torch.int64, device=self.device)
        self.broadcast(t)
        if int(t.item()) != token:
            raise RuntimeError(f"weight group {prefix}: handshake got {int(t.item())}, expected {token}")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 in place; raises on a dead peer or after the timeout."""
        if self.pg is None:
            raise RuntimeError("weight group is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = _delta(self.timeout_s)
        work = self.pg.broadcast([tensor], opts)
        if self.cuda:
            # NCCL: wait() only orders streams; poll so a stalled peer cannot hold us longer.
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"broadcast of {tensor.numel()} bytes not done in {self.timeout_s:g}s")
                time.sleep(0.0005)
        work.wait()  # gloo: blocks, bounded by the timeout; NCCL: raises the work's error, if any

    def close(self) -> None:
        """Abort the group (unblocking any pending broadcast) and drop it and its store."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # aborting an already broken group may fail; it is dropped anyway
                pass


def _gloo(store: dist.Store, rank: int, world_size: int, timeout_s: float, local_host: str) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = _delta(timeout_s)
    # The interface the peers reach this process at (not whatever the hostname resolves to).
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
    pg._set_sequence_number_for_group()
    return pg


def _nccl(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    # Our own deadline (see broadcast) aborts first; the watchdog is the backstop.
    opts._timeout = _delta(2 * timeout_s)
    # A failed weight sync is this group's error, not the process's: on the watchdog's
    # timeout abort the communicator only (2, CleanUpOnly) instead of the default,
    # which tears the process down. Read once, by the constructor.
    with _ENV_LOCK:
        old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            pg = ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if old is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old
    pg._set_sequence_number_for_group()
    return pg


def describe(exc: BaseException) -> str:
    """A one-line cause: type and message, without gloo's source location and advice."""
    text = str(exc).split(" This is typically caused by", 1)[0]
    text = re.sub(r"\[/[^\]]*\]\s*", "", " ".join(text.split()))
    return f"{type(exc).__name__}: {text}"[:500] if text else type(exc).__name__


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
