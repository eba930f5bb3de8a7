"""FSDP2 (`fully_shard`) wrapping of the trainer's and critic's models from verl-style `FSDPConfig` fields.

Invariant: after `loss.backward()` and `finish_backward(model)`, every rank holds the
data-parallel *mean* of the per-rank gradients, for every parameter and every setting
(sharded params as DTensor shards, ignored / `use_fsdp=False` params as full tensors).

Loss scaling rule (`FSDPEngineBase.train_step` relies on it). For a global loss
`L = sum(token losses over all ranks) / num_global_tokens`, each rank backpropagates

    loss_for_backward = sum(local token losses) / num_global_tokens * world_size

because the gradients are averaged over ranks, not summed. The value to report is the
unscaled `sum(local) / num_global_tokens`, all-reduced with SUM. Averaging is linear, so
this also holds under gradient accumulation with `finish_backward` after every backward.

A step is: backward, `finish_backward(model)`, `clip_grad_norm_(model, max_norm)`, then an
optimizer built on `optimizer_param_groups(model)`. torch's own clip and foreach optimizers
refuse the mix of DTensor and plain params that `ignored_modules` makes; these do not.

Mapping onto FSDP2 (W = world size, H = `hybrid_shard_size`):

| verl field = value              | FSDP2                                                                     |
|---------------------------------|---------------------------------------------------------------------------|
| sharding_strategy=FULL_SHARD    | 1-D mesh (W,); blocks `reshard_after_forward=True`                        |
| sharding_strategy=SHARD_GRAD_OP | 1-D mesh (W,); blocks `reshard_after_forward=False`                       |
| sharding_strategy=NO_SHARD      | 2-D mesh (W, 1) ("replicate", "shard"): HSDP, groups of 1 = DDP           |
| sharding_strategy=HYBRID_SHARD  | 2-D mesh (W/H, H); H=0: LOCAL_WORLD_SIZE, else W; W % H != 0: error       |
| use_fsdp=false                  | no `fully_shard`; `finish_backward` averages every gradient               |
| cpu_offload=true                | `CPUOffloadPolicy(pin_memory=False)`; ValueError on CPU (no accelerator)  |
| mixed_precision={p, r}          | `MixedPrecisionPolicy(param_dtype=p, reduce_dtype=r)`; null: none         |
| backward_prefetch=BACKWARD_PRE  | root and each block prefetch the next 2 blocks in backward order          |
| backward_prefetch=BACKWARD_POST | nothing set: FSDP2's implicit one-block backward prefetch                 |
| backward_prefetch=none          | each module "prefetches" itself (a no-op): implicit prefetch off          |
| ignored_modules=[patterns]      | their params: `ignored_params=` everywhere, averaged by `finish_backward` |

The root (embeddings, final norm, lm_head) always has `reshard_after_forward=False`:
backward starts with it, so resharding it would only repeat its all-gather. A forward under
`torch.no_grad()` reshards everything when it ends, since no backward will.

On ONE rank (W = 1) nothing is sharded, and FSDP2's gathers and reductions are only
copies and casts (a quarter of the H200's time in a 1.5B step): the blocks then keep their
parameters from forward to backward (`reshard_after_forward=False`, +1 bf16 copy of the
weights), and `gradient_sync_once(model)` says so: the engine keeps the parameters
gathered over the micro-batches of an optimizer step and reduces the gradients once,
after the last (FSDP2 accumulates them in the reduce dtype meanwhile: the same sums), or
after every micro-batch with `fsdp.one_rank_accumulation=reduced` (see `sync_after`).
"""

from __future__ import annotations

import fnmatch
import functools
import os
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from roles.training.hf_loading import DTYPES
from runtime.config import FSDPConfig

# Wrappers that insert a path component into parameter names (checkpointing, compile, FSDP1).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_REPLICATED_ATTR = "_tandem_replicated_params"


def wrap_model_with_fsdp(model: nn.Module, fsdp_config: FSDPConfig, *, device: torch.device | None = None) -> nn.Module:
    """Shard `model` in place per `fsdp_config` and return it; call `finish_backward` after each backward.

    Every rank must hold the same weights before the call (FSDP2 shards each rank's copy;
    nothing is broadcast). `device` defaults to the current CUDA device, else CPU; on CUDA
    set the rank's device (`torch.cuda.set_device`) first.
    """
    device = device or _default_device()
    _check_config(fsdp_config, device)
    ignored = _ignored_params(model, fsdp_config.ignored_modules)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("wrap_model_with_fsdp needs torch.distributed initialised (init_process_group first)")
    if not fsdp_config.use_fsdp:
        model.to(device)
        setattr(model, _REPLICATED_ATTR, tuple(p for p in model.parameters() if p.requires_grad))
        return model
    mesh = _mesh(fsdp_config, device.type)
    for param in ignored:
        # fully_shard leaves ignored params where they are; the forward needs them on `device`.
        param.data = param.data.to(device)
    blocks = find_blocks(model)
    mp_policy = _mp_policy(fsdp_config)
    # Pageable host shards: torch's pinned allocator rounds each shard up to a power of two
    # (1.9x the host memory of a 7B model's float32 shards; roles/fsdp/offload.py says the same
    # of AdamW's moments), and FSDP2 pins gradients the same way.
    offload_policy = CPUOffloadPolicy(pin_memory=False) if fsdp_config.cpu_offload else OffloadPolicy()
    ignored_params = set(ignored) or None

    def shard(module: nn.Module, reshard_after_forward: bool) -> None:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
        )

    reshard_blocks = fsdp_config.sharding_strategy != "SHARD_GRAD_OP" and dist.get_world_size() > 1
    for block in reversed(blocks):  # bottom-up: a nested block is sharded before its parent
        shard(block, reshard_blocks)
    shard(model, False)
    _set_backward_prefetch(model, blocks, fsdp_config.backward_prefetch)
    model.register_forward_hook(functools.partial(_reshard_without_grad, [model, *blocks]))
    setattr(model, _REPLICATED_ATTR, tuple(p for p in ignored if p.requires_grad))
    return model


def gradient_sync_once(model: nn.Module) -> FSDPModule | None:
    """`model` when the engine should reduce its gradients and reshard its parameters only
    after the last micro-batch of an optimizer step (`sync_after(model, last)` before each
    backward): an FSDP2 model on one rank (see the module docstring); else None."""
    return model if isinstance(model, FSDPModule) and dist.get_world_size() == 1 else None


def reduces_each_micro_batch(fsdp_config: FSDPConfig) -> bool:
    """Whether one rank reduces every micro-batch's gradients (`sync_after`'s `reduce_each`):
    `fsdp.one_rank_accumulation=reduced`, or `fsdp.cpu_offload`, whose sharded gradients live
    in host memory, where FSDP2 adds each micro-batch's (an unsharded float32 copy kept on the
    GPU would hold 4 bytes per parameter there: 30.5 GB of a 7.6B model)."""
    return fsdp_config.one_rank_accumulation == "reduced" or fsdp_config.cpu_offload


def sync_after(model: FSDPModule, last: bool, *, reduce_each: bool = False) -> None:
    """The coming backward reshards parameters only if `last`: else they stay gathered for
    the next micro-batch's forward. It reduces gradients if `last` or `reduce_each`; else
    FSDP2 adds them into an unsharded copy in the reduce dtype (one mixed-dtype add per
    parameter in the backward's stream), where `reduce_each` casts each block's into its
    flat reduce buffer (one kernel) and adds that to the sharded gradient on the reduce
    stream: the same sums in the same order (`fsdp.one_rank_accumulation`).
    `sync_after(model, True)` restores the default."""
    model.set_requires_gradient_sync(last or reduce_each)
    model.set_reshard_after_backward(last)


def finish_backward(model: nn.Module) -> None:
    """Average over all ranks the gradients FSDP does not reduce (ignored / unsharded params).

    A collective: every rank calls it after every backward. A missing gradient counts as
    zeros so that all ranks reduce the same buffers. A no-op when nothing is left unreduced.
    """
    params = getattr(model, _REPLICATED_ATTR, ())
    if not params:
        return
    world_size = dist.get_world_size()
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in params:
        buckets.setdefault((param.grad.dtype, param.grad.device), []).append(param.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # gloo has no AVG
        flat /= world_size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def full_state_dict_items(
    model: nn.Module, keep: Callable[[str], bool] | None = None, *, on_mesh_device: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every `model.state_dict()` entry, in order (only
    the names `keep` accepts, when given: the others are not gathered). A CPU-offloaded
    shard comes back gathered where it lives, or with `on_mesh_device` where it was gathered
    (the GPU: the weight export packs it there, without a round trip through host memory).

    A collective when the model is sharded: every rank must iterate it to the end in the
    same order. Tied entries (embeddings / lm_head) are gathered once and yielded twice.
    """
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if keep is None or keep(_plain_name(k))}
    counts: dict[int, int] = {}
    for tensor in state.values():
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    gathered: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        full = gathered.get(id(tensor))
        if full is None:
            full = _full_tensor(tensor.detach(), on_mesh_device)
            if counts[id(tensor)] > 1:
                gathered[id(tensor)] = full
        yield _plain_name(name), full


def optimizer_param_groups(model: nn.Module) -> list[dict[str, list[nn.Parameter]]]:
    """Trainable params as [sharded (DTensor)] and [replicated (plain)] groups, empty ones left out.

    foreach / fused optimizers refuse a list that mixes DTensors and plain tensors, which
    `ignored_modules` produces; an optimizer steps each param group on its own.
    """
    sharded, replicated = _split_params(model)
    return [{"params": group} for group in (sharded, replicated) if group]


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale all gradients to a global L2 norm of at most `max_norm`; return the norm before.

    A collective (every rank calls it after `finish_backward`); the returned norm is the
    full model's, equal on every rank. Unlike `torch.nn.utils.clip_grad_norm_`, it takes
    the DTensor / plain mix that `ignored_modules` produces and CPU-offloaded shards.
    """
    sharded, replicated = _split_params(model)
    sharded_grads = [cast(DTensor, p.grad).to_local() for p in sharded if p.grad is not None]
    replicated_grads = [p.grad for p in replicated if p.grad is not None]
    squares = []
    if sharded:
        mesh = cast(DTensor, sharded[0]).device_mesh
        # Shards split the last mesh dim (the replicate dim, if any, holds copies).
        square = _sum_of_squares(sharded_grads, mesh.device_type)
        dist.all_reduce(square, group=mesh.get_group(mesh.ndim - 1))
        squares.append(square)
    if replicated_grads:
        squares.append(_sum_of_squares(replicated_grads, replicated_grads[0].device.type))
    total_norm = torch.stack([sq.to(squares[0].device) for sq in squares]).sum().sqrt()
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for grads in (sharded_grads, replicated_grads):
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].device))
    return total_norm


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks in forward order: HF `_no_split_modules` classes, else the
    children of the first non-empty `nn.ModuleList`."""
    class_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in class_names]
    if blocks:
        return blocks
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    raise ValueError(f"no transformer blocks found in {type(model).__name__}: no _no_split_modules, no ModuleList")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_config(fsdp_config: FSDPConfig, device: torch.device) -> None:
    if fsdp_config.cpu_offload and (device.type == "cpu" or not torch.cuda.is_available()):
        raise ValueError(
            f"fsdp.cpu_offload=true needs an accelerator: the trainer runs on {device.type} here; "
            "set fsdp.cpu_offload=false"
        )
    if fsdp_config.mixed_precision is not None and not fsdp_config.use_fsdp:
        raise ValueError("fsdp.mixed_precision needs fsdp.use_fsdp=true; set it to null or enable FSDP")
    if fsdp_config.mixed_precision is not None and fsdp_config.ignored_modules:
        # Ignored params keep their dtype, so their modules would meet low-precision inputs.
        raise ValueError("fsdp.ignored_modules cannot be combined with fsdp.mixed_precision; set one of them empty")


def _ignored_params(model: nn.Module, patterns: list[str]) -> list[nn.Parameter]:
    names = [name for name, _ in model.named_modules()]
    params: dict[int, nn.Parameter] = {}
    for pattern in patterns:
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(f"fsdp.ignored_modules: pattern {pattern!r} matches no module of the model")
        for name in matched:
            for param in model.get_submodule(name).parameters():
                params[id(param)] = param
    return list(params.values())


def _mesh(fsdp_config: FSDPConfig, device_type: str) -> DeviceMesh:
    world_size = dist.get_world_size()
    strategy = fsdp_config.sharding_strategy
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    shard_size = 1 if strategy == "NO_SHARD" else _hybrid_shard_size(fsdp_config, world_size)
    shape = (world_size // shard_size, shard_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def _hybrid_shard_size(fsdp_config: FSDPConfig, world_size: int) -> int:
    size = fsdp_config.hybrid_shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % size != 0:
        raise ValueError(f"fsdp.hybrid_shard_size={size} must divide the trainer world size {world_size}")
    return size


def _mp_policy(fsdp_config: FSDPConfig) -> MixedPrecisionPolicy:
    mp = fsdp_config.mixed_precision
    if mp is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[mp.param_dtype], reduce_dtype=DTYPES[mp.reduce_dtype])


def _set_backward_prefetch(root: nn.Module, blocks: list[nn.Module], mode: str) -> None:
    if mode == "BACKWARD_POST":
        return
    # Backward runs the root first, then the blocks last to first. torch 2.13 reads an empty
    # list as "keep the implicit prefetch"; a module is already unsharded when its own list
    # runs, so [module] prefetches nothing and is how "none" switches prefetching off.
    order = cast(list[FSDPModule], [root, *reversed(blocks)])
    for i, module in enumerate(order):
        targets = order[i + 1 : i + 3] if mode == "BACKWARD_PRE" else [module]
        if targets:
            module.set_modules_to_backward_prefetch(targets)


def _split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Trainable params as ([DTensor ones], [plain ones])."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trainable if isinstance(p, DTensor)], [p for p in trainable if not isinstance(p, DTensor)]


def _sum_of_squares(grads: list[torch.Tensor], device_type: str) -> torch.Tensor:
    if not grads:  # this rank's shards are all empty
        return torch.zeros((), device=device_type)
    norms = torch._foreach_norm(grads)
    return torch.stack(norms).float().square().sum().to(device_type)


def _reshard_without_grad(fsdp_modules: list[nn.Module], *_: object) -> None:
    # A forward under no_grad has no backward to reshard what it left gathered (the root,
    # SHARD_GRAD_OP blocks): the reference model and logprob recomputes would keep it all.
    if not torch.is_grad_enabled():
        for module in fsdp_modules:
            cast(FSDPModule, module).reshard()


def _full_tensor(tensor: torch.Tensor, on_mesh_device: bool = False) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor
    mesh_device = tensor.device_mesh.device_type
    if tensor.device.type != mesh_device:
        # CPU-offloaded shards (and their norms): gather on the mesh's device, as torch's
        # _state_dict_utils does, since the mesh's process group may not reduce CPU tensors.
        full = cast(DTensor, tensor.to(mesh_device)).full_tensor()
        return full if on_mesh_device else full.to(tensor.device)
    return tensor.full_tensor()


def _plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
