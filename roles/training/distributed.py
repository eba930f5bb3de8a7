"""Where a torch role's rank runs: its device and its default process group.

Shared by every engine (FSDP actor, critic, Megatron actor). The launcher sets RANK,
WORLD_SIZE, MASTER_ADDR / MASTER_PORT and LOCAL_RANK; the default group is NCCL on CUDA
and gloo on CPU, and is made once per process.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.config import RunConfig
from runtime.launch.rendezvous import STORE_FD_ENV, handed_fd


def pick_device(cfg: RunConfig) -> torch.device:
    """This rank's device. With `devices` in its placement the launcher gives each rank
    exactly its own GPUs (CUDA_VISIBLE_DEVICES), so the rank uses the first visible one;
    otherwise every GPU is visible and the local rank picks one."""
    want = cfg.trainer.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        visible = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local if local < visible else local % max(1, visible))
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float) -> None:
    """Join this role's world from the launcher's RANK/WORLD_SIZE/MASTER_* variables; the
    rendezvous and every collective of the default group are bounded by `timeout_s`
    (`trainer.collective_timeout_s`), not torch's default of 10 (gloo 30) minutes."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend=backend,
        store=_world_store(rank, world, timeout),
        rank=rank,
        world_size=world,
        device_id=device if device.type == "cuda" else None,
        timeout=timeout,
    )


def _world_store(rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The world's TCPStore on MASTER_ADDR:MASTER_PORT, served by rank 0: on the listening
    socket its launcher bound and handed over where there is one (runtime.launch.rendezvous), else
    on a socket it binds now (a port given with --master-port). Every rank makes its own
    store this one way, so they all see the same keys. Rank 0 waits, at most `timeout`, for
    every rank to connect."""
    fd = handed_fd(STORE_FD_ENV) if rank == 0 else None
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=fd,
    )
