"""GPU placement checks: requested GPUs exist, and the processes sharing a GPU fit in it.

Both checks are pure and fail with a one-line `ConfigError` naming the placement entry
(`placement[i]`, its index in `placement`, or in the default placement when that is empty):

* `check_gpu_memory(cfg)` reads only the config. `validate.check_config` runs it, so
  `tandem launch` refuses an over-committed GPU before anything starts, on any machine.
* `check_gpu_devices(cfg, device_count, node)` compares the entries placed on `node` with
  the GPUs that node has. It needs the real count, which only torch knows, so it does not
  run at config load (a recipe for 2 GPUs still loads and validates on a laptop): the
  launcher calls it with `placement.visible_gpus()`.

Which processes use a GPU: rollout and reward processes given `devices`; trainer and
critic processes unless `trainer.device=cpu`; never the controller. A role on the CPU may
list devices (they only set CUDA_VISIBLE_DEVICES) and is not checked.

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
from runtime.config.load import ConfigError
from runtime.launch.placement import TORCH_WORLDS, entries

TRAINER_MIN_FRACTION = 0.2
_EPS = 1e-9


@dataclass(frozen=True)
class Claim:
    entry: str  # "placement[3] (trainer)"
    role: str
    fraction: float


def label(index: int, e: PlacementEntry) -> str:
    return f"placement[{index}] ({e.role})"


def uses_gpu(cfg: RunConfig, role: str) -> bool:
    if role == "controller":
        return False
    if role in TORCH_WORLDS:
        return cfg.trainer.device != "cpu"
    return True


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
            for devices in _process_devices(e):
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


def _process_devices(e: PlacementEntry) -> list[list[int]]:
    """The GPUs of each of the entry's processes, as `placement` assigns them."""
    if not e.devices:
        return []
    if len(e.devices) == e.count:
        return [[d] for d in e.devices]
    return [list(e.devices)] * e.count


def _trainer_rank0(cfg: RunConfig) -> tuple[str, int, set[int]] | None:
    """Where placement puts trainer rank 0: its entry's label, node and GPUs (None when the
    trainer entry names no devices)."""
    found = next(((i, e) for i, e in enumerate(entries(cfg)) if e.role == "trainer" and e.devices), None)
    if found is None:
        return None
    i, e = found
    return label(i, e), (e.nodes[0] if e.nodes else e.node), set(_process_devices(e)[0])


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
        shared = gpus0 & {d for devs in _process_devices(e) for d in devs}
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
            for devs in _process_devices(e):
                if node != node0 or set(devs) != gpus0:
                    raise ConfigError(
                        f"weight_sync.backend=ipc: {label(i, e)} is on GPU {devs} of node {node}, trainer rank 0 "
                        f"({where}) on GPU {sorted(gpus0)} of node {node0}; ipc needs them "
                        "on one GPU: use weight_sync.backend=nccl (or auto) for separate GPUs"
                    )


@dataclass(frozen=True)
class Placed:
    """One process as placement puts it: its role, rank (per role kind), node and GPUs
    (empty when its entry names no devices: the GPU is then only known at run time)."""

    role: str
    rank: int
    node: int
    devices: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def gpus(self) -> set[tuple[int, int]]:
        return {(self.node, d) for d in self.devices}


def placed_processes(cfg: RunConfig) -> list[Placed]:
    """Every process of the run on every node, ranks numbered per role kind (as the launcher does)."""
    out: list[Placed] = []
    next_rank: dict[str, int] = {}
    for e in entries(cfg):
        for node in e.nodes or [e.node]:
            per_process = _process_devices(e) or [[]] * e.count
            for devs in per_process[: e.count]:
                r = next_rank.get(e.role, 0)
                next_rank[e.role] = r + 1
                out.append(Placed(e.role, r, node, tuple(devs)))
    return out


def rollout_shares_trainer_gpu(cfg: RunConfig, rank: int) -> bool:
    """Whether placement puts rollout `rank` on a GPU (same node, same index) of some
    trainer rank. Processes placed without `devices` never count: their GPU is only known
    at run time."""
    procs = placed_processes(cfg)
    mine = {g for p in procs if p.role == "rollout" and p.rank == rank for g in p.gpus}
    return bool(mine & {g for p in procs if p.role == "trainer" for g in p.gpus})


def rollout_sleeps(cfg: RunConfig, rank: int) -> bool:
    """Whether rollout `rank` puts vLLM to sleep while the trainer steps: a synchronous run
    (`max_staleness: 0`) with `sleep_when_idle`, on a GPU of a trainer rank."""
    return (
        cfg.rollout.engine.sleep_when_idle and cfg.rollout.max_staleness == 0 and rollout_shares_trainer_gpu(cfg, rank)
    )


def trainer_gives_way(cfg: RunConfig, rank: int) -> bool:
    """Whether trainer `rank` shares its GPU with a rollout that sleeps while it steps, and
    so must give its memory back before that rollout wakes (roles/trainer/role.py)."""
    procs = placed_processes(cfg)
    mine = {g for p in procs if p.role == "trainer" and p.rank == rank for g in p.gpus}
    return any(p.role == "rollout" and p.gpus & mine and rollout_sleeps(cfg, p.rank) for p in procs)
