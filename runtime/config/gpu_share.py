"""GPUs shared by the processes a placement puts on them, checked from the config alone: the
memory fractions on one GPU fit, and the weight-sync backend suits where trainer rank 0 and
the rollouts are. Each check fails with a one-line `ConfigError` naming the placement entry
(`placement[i]`, its index in `placement`, or in the default placement when that is empty).

Memory claims, per GPU (node, index): a rollout process claims
`rollout.engine.gpu_memory_utilization` on every GPU it is given (vLLM takes that fraction
of the whole GPU), a reward_model serving a judge `reward.judge.engine.gpu_memory_utilization`
(a classifier has no memory setting and is not counted). Trainers and critics have no
memory setting of their own: each claims `TRAINER_MIN_FRACTION` (a fifth of the GPU, what
they are sure to need beside vLLM), i.e. a trainer sharing a GPU with a rollout needs
`1 - gpu_memory_utilization >= 0.2`. The claims on one GPU must sum to at most 1.0.
Processes placed without `devices` are not counted: which GPU they land on is only known
at run time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from runtime.config import PlacementEntry, RunConfig
from runtime.config.placement import entries, label, process_devices, uses_gpu
from runtime.errors import ConfigError

TRAINER_MIN_FRACTION = 0.2
_EPS = 1e-9


@dataclass(frozen=True)
class Claim:
    entry: str  # "placement[3] (trainer)"
    role: str
    fraction: float


def gpu_claims(cfg: RunConfig) -> dict[tuple[int, int], list[Claim]]:
    """The memory claims on each (node, GPU index) that placement names explicitly."""
    claims: dict[tuple[int, int], list[Claim]] = defaultdict(list)
    fractions = {
        "rollout": cfg.rollout.engine.gpu_memory_utilization,
        "trainer": TRAINER_MIN_FRACTION,
        "critic": TRAINER_MIN_FRACTION,
    }
    if cfg.reward.judge.model:
        fractions["reward_model"] = cfg.reward.judge.engine.gpu_memory_utilization
    if cfg.algorithm.distill.enabled:
        fractions["teacher"] = cfg.algorithm.distill.engine.gpu_memory_utilization
    for i, e in enumerate(entries(cfg)):
        if e.role not in fractions or not uses_gpu(cfg, e.role):
            continue
        fraction = fractions[e.role]
        for node in e.nodes or [e.node]:
            for devices in process_devices(e):
                for d in devices:
                    claims[(node, d)].append(Claim(label(i, e), e.role, fraction))
    return claims


def check_gpu_memory(cfg: RunConfig) -> None:
    """The claims on every GPU sum to at most 1.0 (see the module docstring)."""
    for (node, gpu), claims in sorted(gpu_claims(cfg).items()):
        total = sum(c.fraction for c in claims)
        if total <= 1.0 + _EPS:
            continue
        parts = " + ".join(f"{c.entry} {c.fraction:g}" for c in claims)
        raise ConfigError(f"GPU {gpu} of node {node} is over-committed: {parts} = {total:.2f} > 1.0; {_fix(claims)}")


def _fix(claims: list[Claim]) -> str:
    if any(c.role == "reward_model" for c in claims):
        util = "gpu_memory_utilization"
        return f"lower reward.judge.engine.{util} or rollout.engine.{util}, or use other GPUs"
    if any(c.role == "teacher" for c in claims):
        util = "gpu_memory_utilization"
        return f"lower algorithm.distill.engine.{util} or rollout.engine.{util}, or use other GPUs"
    rollouts = sum(1 for c in claims if c.role == "rollout")
    others = sum(c.fraction for c in claims if c.role != "rollout")
    fits = int((1.0 - others) / max(rollouts, 1) * 100 + _EPS) / 100
    if rollouts and fits >= 0.05:
        why = f" (trainer/critic processes claim {TRAINER_MIN_FRACTION:g} each)" if others else ""
        return f"lower rollout.engine.gpu_memory_utilization to {fits:g} or less{why}, or use other GPUs"
    return f"each trainer/critic process needs {TRAINER_MIN_FRACTION:g} of a GPU: spread them over more GPUs"


def _trainer_rank0(cfg: RunConfig) -> tuple[str, int, set[int]] | None:
    """Where placement puts trainer rank 0: its entry's label, node and GPUs (None when the
    trainer entry names no devices)."""
    found = next(((i, e) for i, e in enumerate(entries(cfg)) if e.role == "trainer" and e.devices), None)
    if found is None:
        return None
    i, e = found
    return label(i, e), (e.nodes[0] if e.nodes else e.node), set(process_devices(e)[0])


def _placed_rollouts(cfg: RunConfig) -> list[tuple[int, PlacementEntry]]:
    """Rollout entries that name their GPUs, with their index in placement."""
    return [(i, e) for i, e in enumerate(entries(cfg)) if e.role == "rollout" and e.devices]


def check_nccl_weight_sync(cfg: RunConfig) -> None:
    """`weight_sync.backend=nccl` joins trainer rank 0 and each rollout's workers in one NCCL
    group, and NCCL cannot hold two ranks on one GPU: a rollout placed on trainer rank 0's GPU
    (a colocated placement) must use the `ipc` backend (`auto` picks it)."""
    if cfg.weight_sync.backend != "nccl" or (rank0 := _trainer_rank0(cfg)) is None:
        return
    where, node0, gpus0 = rank0
    for i, e in _placed_rollouts(cfg):
        shared = gpus0 & {d for devs in process_devices(e) for d in devs}
        if node0 in (e.nodes or [e.node]) and shared:
            raise ConfigError(
                f"weight_sync.backend=nccl: {label(i, e)} shares GPU {min(shared)} with trainer rank 0 "
                f"({where}); NCCL cannot hold two ranks on one GPU: "
                "use weight_sync.backend=ipc (or auto) for colocated placements"
            )


def check_ipc_weight_sync(cfg: RunConfig) -> None:
    """`weight_sync.backend=ipc` hands trainer rank 0's GPU buffers to vLLM by CUDA IPC: the
    trainer must be on a GPU, and every rollout that placement puts on a GPU must be on
    trainer rank 0's (the GPU UUIDs are checked again at run time)."""
    if cfg.weight_sync.backend != "ipc":
        return
    if cfg.trainer.device == "cpu":
        raise ConfigError("weight_sync.backend=ipc needs trainer.device=cuda or auto (it is cpu)")
    if (rank0 := _trainer_rank0(cfg)) is None:
        return
    where, node0, gpus0 = rank0
    for i, e in _placed_rollouts(cfg):
        for node in e.nodes or [e.node]:
            for devs in process_devices(e):
                if node != node0 or set(devs) != gpus0:
                    raise ConfigError(
                        f"weight_sync.backend=ipc: {label(i, e)} is on GPU {devs} of node {node}, trainer rank 0 "
                        f"({where}) on GPU {sorted(gpus0)} of node {node0}; ipc needs them "
                        "on one GPU: use weight_sync.backend=nccl (or auto) for separate GPUs"
                    )
