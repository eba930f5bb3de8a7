"""Which weight-sync backend a run uses (`weight_sync.backend`), decided by trainer rank 0
once it knows its rollouts.

`auto` (the default) picks `ipc` when every rollout's GPU is trainer rank 0's own (same
GPU UUID: colocated), `nccl` when the trainer and every rollout are on CUDA but not all on
that GPU, and `zmq` otherwise (CPU, or a rollout without a GPU). An explicit `ipc` with a
rollout elsewhere, or without a CUDA trainer, is refused with one line; so is an explicit
`nccl` with a rollout on trainer rank 0's own GPU (NCCL cannot connect two processes on one
GPU). Rollouts say where they run in their registration (`PeerInfo.capabilities["gpu_uuid"]`,
"" on CPU). `make_transfer` builds the chosen backend's transfer.
"""

from __future__ import annotations

import torch

from roles.weights.sender import Transfer
from roles.weights.transfers import IpcTransfer, NcclTransfer, ZmqTransfer
from runtime.errors import TandemError
from transport.wire import PeerInfo

BACKENDS = ("auto", "zmq", "nccl", "ipc")


class BackendError(TandemError, ValueError):
    """A backend that cannot serve this placement."""


def rollout_gpu(peer: PeerInfo) -> str:
    return str(peer.capabilities.get("gpu_uuid", ""))


def choose_backend(requested: str, trainer_device: torch.device, trainer_uuid: str, rollouts: list[PeerInfo]) -> str:
    """The backend for trainer rank 0 on `trainer_device` (GPU `trainer_uuid`, "" on CPU)."""
    if requested not in BACKENDS:
        raise BackendError(f"weight_sync.backend={requested!r}: valid are {', '.join(BACKENDS)}")
    cuda = trainer_device.type == "cuda"
    elsewhere = [f"{p.role}-{p.rank}" for p in rollouts if rollout_gpu(p) != trainer_uuid or not cuda]
    if requested == "ipc":
        if not cuda:
            raise BackendError("weight_sync.backend=ipc needs trainer rank 0 on a GPU (it is on the CPU)")
        if elsewhere:
            where = ", ".join(f"{p.role}-{p.rank} on {rollout_gpu(p) or 'the CPU'}" for p in rollouts)
            raise BackendError(
                f"weight_sync.backend=ipc needs every rollout on trainer rank 0's GPU {trainer_uuid}: {where}"
            )
        return "ipc"
    if requested == "nccl" and cuda:
        shared = [f"{p.role}-{p.rank}" for p in rollouts if rollout_gpu(p) == trainer_uuid]
        if shared:
            raise BackendError(
                f"weight_sync.backend=nccl cannot reach {', '.join(shared)} on trainer rank 0's own GPU "
                f"{trainer_uuid} (NCCL needs one GPU per process): use ipc (or auto)"
            )
    if requested != "auto":
        return requested
    if cuda and rollouts and not elsewhere:
        return "ipc"
    if cuda and rollouts and all(rollout_gpu(p) for p in rollouts):
        return "nccl"
    return "zmq"


def make_transfer(
    backend: str, *, timeout_s: float, token: str, device: torch.device, host: str, workers_per_rollout: int
) -> Transfer:
    """The transfer of `backend` (a `choose_backend` result) for trainer rank 0 on `device`;
    `host`: the address rollouts reach this process at (nccl's store), `workers_per_rollout`:
    vLLM workers per rollout (its tensor-parallel size)."""
    if backend == "ipc":
        return IpcTransfer(timeout_s, token=token)
    if backend == "nccl":
        return NcclTransfer(timeout_s, token=token, host=host, device=device, workers_per_rollout=workers_per_rollout)
    if backend == "zmq":
        return ZmqTransfer(timeout_s, token=token)
    raise BackendError(f"no transfer for weight-sync backend {backend!r}")
