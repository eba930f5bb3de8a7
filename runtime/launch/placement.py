"""Which role processes a node runs, with their environment; checked before any starts.

`plan_processes(cfg, node)` returns one `ProcSpec` per process of that node. Trainer
ranks get the torch.distributed rendezvous variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and GPU roles get CUDA_VISIBLE_DEVICES from `devices`.
Device indices count the GPUs this launcher sees: under `CUDA_VISIBLE_DEVICES=2,3`,
`devices: [0]` is physical GPU 2 (as torch, vLLM and Ray read them), so a launch confined
to some GPUs of a shared machine never lands on the others.
Impossible placements raise `PlacementError` with a one-line reason. What the config alone says
of the placement (its entries, role counts, each process's GPUs) is runtime/config/placement.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from runtime.config import PlacementEntry, RunConfig
from runtime.config.placement import TORCH_WORLDS, entries, per_node, role_counts
from runtime.errors import TandemError


class PlacementError(TandemError, ValueError):
    """A placement that cannot run."""


@dataclass
class ProcSpec:
    role: str
    rank: int
    node: int = 0
    devices: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


def plan_processes(
    cfg: RunConfig, node: int = 0, *, master_addr: str = "127.0.0.1", master_port: int = 0
) -> list[ProcSpec]:
    """The processes of `node`, ranks numbered per role kind across all nodes."""
    counts = role_counts(cfg)
    if counts.get("controller", 0) != 1:
        raise PlacementError(f"placement must have exactly one controller, has {counts.get('controller', 0)}")
    for needed in ("rollout", "trainer"):
        if counts.get(needed, 0) < 1:
            raise PlacementError(f"placement needs at least one {needed}")
    if cfg.algorithm.advantage == "gae" and counts.get("critic", 0) < 1:
        raise PlacementError("algorithm.advantage=gae needs a critic in placement")
    if any(n != 0 for e, n in per_node(cfg) if e.role == "controller"):
        raise PlacementError("the controller runs on node 0 (placement of controller: node 0)")
    next_rank: dict[str, int] = {}
    specs: list[ProcSpec] = []
    for e, n in per_node(cfg):
        for i in range(e.count):
            rank = next_rank.get(e.role, 0)
            next_rank[e.role] = rank + 1
            if n == node:
                specs.append(_spec(e, i, rank, n))
    _add_dist_env(specs, cfg, counts, master_addr, master_port)
    return specs


def _spec(e: PlacementEntry, i: int, rank: int, node: int) -> ProcSpec:
    devices = _devices_for(e, i)
    env = dict(e.env)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_device_names(devices))
    return ProcSpec(role=e.role, rank=rank, node=node, devices=devices, env=env)


def plan_join(cfg: RunConfig, node: int) -> list[ProcSpec]:
    """Rollout processes for a launcher joining a running job (`--join`): the rollout
    entries placed on `node` (or the first rollout entry's count), ranked 1000 + 100*node + i
    so joiners never collide with the job's own rollout ranks."""
    chosen = [e for e, n in per_node(cfg) if e.role == "rollout" and n == node]
    if not chosen:
        chosen = [e for e in entries(cfg) if e.role == "rollout"][:1]
    specs: list[ProcSpec] = []
    for e in chosen:
        for i in range(e.count):
            specs.append(_spec(e, i, 1000 + 100 * node + len(specs), node))
    return specs


def _devices_for(e: PlacementEntry, i: int) -> list[int]:
    if not e.devices:
        return []
    if len(e.devices) == e.count:
        return [e.devices[i]]
    if e.role in ("trainer", "critic") and len(e.devices) > 1 and e.count > 1:
        raise PlacementError(
            f"placement of {e.role}: {e.count} processes but {len(e.devices)} devices (give one per process)"
        )
    return list(e.devices)


def visible_device_names(devices: list[int]) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries for placement indices: the launcher's own
    CUDA_VISIBLE_DEVICES entry at each index where it sets one (an index past its end is
    kept as is, for `check_devices` to refuse), else the index itself."""
    inherited = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [inherited[d] if d < len(inherited) else str(d) for d in devices]


def _add_dist_env(specs: list[ProcSpec], cfg: RunConfig, counts: dict[str, int], addr: str, port: int) -> None:
    per_node: dict[tuple[str, int], int] = {}
    for s in specs:
        if s.role not in TORCH_WORLDS:
            continue
        local = per_node.get((s.role, s.node), 0)
        per_node[(s.role, s.node)] = local + 1
        s.env.update(
            RANK=str(s.rank),
            WORLD_SIZE=str(counts[s.role]),
            LOCAL_RANK=str(local),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port + (1 if s.role == "critic" else 0)),
        )
    for (role, _), n in per_node.items():
        for s in specs:
            if s.role == role:
                s.env["LOCAL_WORLD_SIZE"] = str(n)


def check_devices(specs: list[ProcSpec], num_gpus: int) -> None:
    """A device index that does not exist (`num_gpus` on this node) is an error naming the role."""
    for s in specs:
        for d in s.devices:
            if d >= num_gpus:
                raise PlacementError(f"placement of {s.name}: GPU {d} does not exist (this node has {num_gpus})")


def visible_gpus() -> int:
    """GPUs torch sees in this process (0 without torch or CUDA)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
