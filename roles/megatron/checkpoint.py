"""Checkpoints of a Megatron-core engine (actor or critic): one folder, per-rank files.

    megatron-layout.json        {"tp", "pp", "world_size"}: written by rank 0, read by the
                                launcher before anything starts (`runtime/checkpoints/layout.py`)
    megatron-rank<r>.pt         rank r's model shard, optimizer state (the distributed
                                optimizer's non-parameter part), counters and RNG states:
                                torch CPU / CUDA, python, numpy and megatron's CUDA RNG
                                tracker (the tensor-parallel streams dropout draws from)
    megatron-params-tp<t>-pp<p>.pt   with the distributed optimizer only: the parameter
                                state (fp32 main params, Adam moments) of model-parallel
                                coordinate (t, p), gathered on its data-parallel rank 0

Everything is loaded onto the CPU first (a GPU-saved RNG state is a CPU ByteTensor that
`torch.load(map_location=cuda)` would move, which `set_rng_state` refuses) and copied into
the live tensors by their owners. A checkpoint resumes only with the layout it was saved
with; `load_megatron` refuses another in one line.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roles.megatron.model import unwrap
from roles.training.rng import rng_state, set_rng_state
from runtime.checkpoints.layout import LAYOUT_FILE, layout_mismatch


def layout() -> dict[str, int]:
    """This world's Megatron layout (needs megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "world_size": dist.get_world_size(),
    }


def save_megatron(directory: Path, model: torch.nn.Module, optimizer: Any, counters: dict[str, int]) -> None:
    """Write this rank's part of the checkpoint into `directory` (a collective)."""
    from megatron.core import tensor_parallel

    directory.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    state = {
        "layout": layout(),
        "model": unwrap(model).state_dict(),
        "optim": optimizer.state_dict(),
        "counters": counters,
        "rng": rng_state(),
        "megatron_rng": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    torch.save(state, directory / f"megatron-rank{rank}.pt")
    if _distributed(optimizer):
        optimizer.save_parameter_state(str(_params_file(directory)))  # gathers over the DP group
    if rank == 0:
        (directory / LAYOUT_FILE).write_text(json.dumps(layout()))
    dist.barrier()


def load_megatron(directory: Path, model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Restore what `save_megatron` wrote into the live model, optimizer and RNG streams;
    returns the counters. ValueError (one line) for a missing file or another layout."""
    from megatron.core import tensor_parallel

    path = directory / f"megatron-rank{dist.get_rank()}.pt"
    if not path.exists():
        raise ValueError(f"{directory} has no Megatron checkpoint for rank {dist.get_rank()} (layout {layout()})")
    state = torch.load(path, weights_only=False, map_location="cpu")
    problem = layout_mismatch(state["layout"], layout())
    if problem:
        raise ValueError(f"{directory}: {problem}")
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    if _distributed(optimizer):
        with torch.no_grad(), _steps_set_aside(optimizer):  # it copies into leaves that require grad
            optimizer.load_parameter_state(str(_params_file(directory)))
    set_rng_state(state["rng"])
    if "megatron_rng" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_rng"])
    counters: dict[str, int] = state.get("counters") or {
        "version": state["version"],
        "optimizer_steps": state.get("optimizer_steps", state["version"]),
    }
    return counters


@contextlib.contextmanager
def _steps_set_aside(optimizer: Any) -> Iterator[None]:
    """torch's Adam keeps a per-parameter `step` beside `exp_avg` / `exp_avg_sq`; megatron's
    `load_parameter_state` copies every key of that state from the file, which (written by
    `save_parameter_state`) holds only the param and the two moments: `KeyError: 'step'` on
    the GPU without TE/apex. The steps (restored by `load_state_dict` just before) are set
    aside for the load and put back after it, each parameter its own copy: megatron's
    `load_state_dict` gives every parameter the SAME step tensor, which Adam's in-place
    `step += 1` would then advance once per parameter (the resumed run's second step
    differed from the uninterrupted one's on the H200)."""
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    kept: list[tuple[dict[str, Any], Any]] = []
    for torch_optimizer in inner:
        for state in getattr(torch_optimizer, "state", {}).values():
            if isinstance(state, dict) and "step" in state:
                kept.append((state, state.pop("step")))
    try:
        yield
    finally:
        for state, step in kept:
            state["step"] = step.clone() if isinstance(step, torch.Tensor) else step


def _distributed(optimizer: Any) -> bool:
    """Whether `optimizer` (megatron's, maybe chained) keeps its parameter state sharded."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def _params_file(directory: Path) -> Path:
    from megatron.core import parallel_state as ps

    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    return directory / f"megatron-params-tp{t}-pp{p}.pt"
