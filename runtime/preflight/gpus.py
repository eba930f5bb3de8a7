"""The GPUs a placement names exist on this node: `check_gpu_devices(cfg, device_count, node)`
compares the entries placed on `node` with the GPUs that node has. It needs the real count,
which only torch knows, so it runs at launch, not when a config is checked (a recipe for 2 GPUs
still loads and validates on a laptop): the launcher calls it with `placement.visible_gpus()`.
A role on the CPU may list devices (they only set CUDA_VISIBLE_DEVICES) and is not checked.
Each failure is a one-line `ConfigError` naming the placement entry.
"""

from __future__ import annotations

from runtime.config import RunConfig
from runtime.config.placement import TORCH_WORLDS, entries, label, uses_gpu
from runtime.errors import ConfigError


def check_gpu_devices(cfg: RunConfig, device_count: int, node: int = 0) -> None:
    """Every GPU index asked for on `node` exists there; a GPU role has a GPU to run on."""
    for i, e in enumerate(entries(cfg)):
        if node not in (e.nodes or [e.node]) or e.count == 0 or not uses_gpu(cfg, e.role):
            continue
        if e.devices and device_count == 0:
            hint = "set trainer.device=cpu or remove" if e.role in TORCH_WORLDS else "remove"
            raise ConfigError(
                f"{label(i, e)} asks for GPU {e.devices[0]} but node {node} has no GPU ({hint} its devices)"
            )
        for d in e.devices:
            if d >= device_count:
                have = "GPU 0" if device_count == 1 else f"GPUs 0-{device_count - 1}"
                raise ConfigError(f"{label(i, e)} asks for GPU {d}, which does not exist: node {node} has only {have}")
        if e.role in TORCH_WORLDS and cfg.trainer.device == "cuda" and device_count == 0:
            raise ConfigError(f"{label(i, e)}: trainer.device=cuda but node {node} has no GPU")
