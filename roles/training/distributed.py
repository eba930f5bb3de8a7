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
    dist.init_process_group(
        backend=backend, device_id=device if device.type == "cuda" else None, timeout=timedelta(seconds=timeout_s)
    )
