"""Trainer rank 0's side of a weight update, for tests and benchmarks that drive a real
rollout role (tests/helpers/harness.py): the same `WeightSender`, transfers and packer the
trainer role uses, fed from a dict of named tensors instead of an engine's export."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from roles.weights.layout import BucketPacker
from roles.weights.sender import PushResult, ThreadSource, Transfer, WeightSender
from roles.weights.transfers import IpcTransfer, NcclTransfer, ZmqTransfer
from runtime.identity import addresses
from runtime.identity.run_token import read_token
from tests.helpers.harness import RoleHarness


class TrainerSide:
    """`backend`'s sender from this process, packing on `device` (the GPU for ipc/nccl)."""

    def __init__(
        self,
        h: RoleHarness,
        backend: str,
        device: torch.device,
        *,
        timeout_s: float,
        bucket_mb: int,
        identity: str = "",
        bucket_bytes: int = 0,
    ) -> None:
        """`identity`: this sender's socket identity (default `trainer-<backend>`); two
        senders alive at once need two (the rollout's ROUTER routes by identity);
        `bucket_bytes`: a bucket size below a MiB (tests), instead of `bucket_mb`."""
        transfer: Transfer
        token = read_token(h.cfg.run_dir)
        if backend == "ipc":
            transfer = IpcTransfer(timeout_s, token=token)
        elif backend == "nccl":
            transfer = NcclTransfer(timeout_s, token=token, host="127.0.0.1", device=device)
        else:
            transfer = ZmqTransfer(timeout_s, token=token)
        opts = addresses.channel_options(h.cfg, h.cfg.run_dir)
        self.sender = WeightSender(h.zmq, opts, identity or f"trainer-{backend}", timeout_s, transfer)
        pack_on = device if backend in ("ipc", "nccl") else torch.device("cpu")
        self.packer = BucketPacker(pack_on, bucket_bytes or bucket_mb << 20)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export")
        self.harness = h

    async def connect(self) -> None:
        assert self.harness.peer is not None
        await self.sender.set_targets([self.harness.peer])

    async def push(self, version: int, tensors: dict[str, torch.Tensor]) -> PushResult:
        source = ThreadSource(self.packer.buckets(iter(tensors.items())), self.pool)
        return await self.sender.push(version, source)

    async def aclose(self) -> None:
        await self.sender.aclose()
        self.pool.shutdown(wait=False)
