"""Where a config places the run's processes, read from the config alone (no machine is
asked): the placement's entries with the roles a config implies, each process with its role,
rank, node and the GPUs its entry names, and which rollouts sleep beside a trainer.

Ranks are numbered per role kind across all nodes, in placement order, as the launcher
numbers them. Which processes use a GPU: rollout and reward processes given `devices`;
trainer and critic processes unless `trainer.device=cpu`; never the controller. Processes
placed without `devices` have no GPU here: which GPU they land on is only known at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import PlacementEntry, RunConfig

DEFAULT_PLACEMENT = (
    PlacementEntry(role="controller"),
    PlacementEntry(role="rollout"),
    PlacementEntry(role="reward"),
    PlacementEntry(role="trainer", count=2),
)
TORCH_WORLDS = ("trainer", "critic")  # the roles whose ranks form a torch.distributed world of their own


def entries(cfg: RunConfig) -> list[PlacementEntry]:
    """The placement's entries, with a critic (gae), a reward_model (reward.model.path or
    reward.judge.model) and a teacher (algorithm.distill.teacher) added on one process each
    when it names none."""
    entries = list(cfg.placement) or list(DEFAULT_PLACEMENT)
    if cfg.algorithm.advantage == "gae" and not any(e.role == "critic" for e in entries):
        entries.append(PlacementEntry(role="critic"))
    r = cfg.reward
    if (r.model.path or r.judge.model) and not any(e.role == "reward_model" for e in entries):
        entries.append(PlacementEntry(role="reward_model"))
    if cfg.algorithm.distill.enabled and not any(e.role == "teacher" for e in entries):
        entries.append(PlacementEntry(role="teacher"))
    return entries


def per_node(cfg: RunConfig) -> list[tuple[PlacementEntry, int]]:
    """(entry, node) pairs: an entry with `nodes` stands for `count` processes on each."""
    return [(e, n) for e in entries(cfg) for n in (e.nodes or [e.node])]


def role_counts(cfg: RunConfig) -> dict[str, int]:
    """Processes per role kind over all nodes."""
    counts: dict[str, int] = {}
    for e, _ in per_node(cfg):
        counts[e.role] = counts.get(e.role, 0) + e.count
    return counts


def wants_gpus(cfg: RunConfig) -> bool:
    """Whether the run asks for GPUs: a CUDA trainer, or any entry that names devices."""
    return cfg.trainer.device == "cuda" or any(e.devices for e in entries(cfg))


def label(index: int, e: PlacementEntry) -> str:
    return f"placement[{index}] ({e.role})"


def uses_gpu(cfg: RunConfig, role: str) -> bool:
    if role == "controller":
        return False
    if role in TORCH_WORLDS:
        return cfg.trainer.device != "cpu"
    return True


def process_devices(e: PlacementEntry) -> list[list[int]]:
    """The GPUs of each of the entry's processes, as `placement` assigns them."""
    if not e.devices:
        return []
    if len(e.devices) == e.count:
        return [[d] for d in e.devices]
    return [list(e.devices)] * e.count


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
            per_process = process_devices(e) or [[]] * e.count
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
