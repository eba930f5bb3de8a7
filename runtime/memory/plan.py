"""The launch-time memory plan: what every GPU and every host will hold, and whether it fits.

`build_plan(cfg, gpu_gb, host_gb)` places each process's consumers (runtime/memory/estimate.py)
on the GPUs placement gives it and adds them up per phase of the loop:

* a GPU whose rollout sleeps while the trainer steps (synchronous, colocated) must hold the
  trainer's step peak beside the sleeping vLLM, and then the trainer's resident memory
  beside the awake vLLM (the update wakes it; the trainer gave its cache back before);
* any other GPU holds everything at once: the trainer's peak beside vLLM's whole share
  (an asynchronous colocated run is an explicit split of the GPU, checked here).

`Plan.problems()` lists what does not fit; `check_plan` turns the first into one
`ConfigError` line naming the GPU, the largest consumer and a setting that makes it fit
(found by planning the run again with that setting). `format_plan` is the table that
`tandem launch --plan` prints and every run logs at its start (`memory_plan`), headed by what
the config's `auto` keys became (runtime/memory/auto.py, `memory.chosen`). Processes placed
without `devices` are planned alone on a GPU of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from runtime.config import RunConfig
from runtime.config.placement import TORCH_WORLDS, Placed, placed_processes, rollout_sleeps, uses_gpu, wants_gpus
from runtime.errors import ConfigError
from runtime.memory.estimate import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_GB,
    GB,
    LORA_ALLOCATOR_SLACK,
    NCCL_GB,
    VLLM_CONTEXT_GB,
    Item,
    ModelShape,
    count_text,
    model_shape,
    rollout_memory,
    trainer_memory,
    vllm_kv_cache_gb,
    weight_sync_items,
)
from runtime.memory.gpu import gpu_totals
from runtime.memory.step_time import StepTime, step_time

GPU_HEADROOM_GB = 2.0  # a GPU fits what is planned on it with this much to spare
PROCESS_HOST_GB = 1.0  # a role process's own host memory (Python, torch, libraries)
VLLM_HOST_GB = 2.0  # a rollout's engine process beside it


@dataclass
class PlannedProcess:
    name: str
    role: str
    items: list[Item]
    context_gb: float
    lora: bool = False  # a trainer training LoRA adapters (its allocator leaves more free blocks)

    def held(self, phase: str) -> float:
        """GB held in `phase`, the `always` items included."""
        return sum(i.gb for i in self.items if i.held_in(phase))

    @property
    def trainer_peak(self) -> float:
        """Allocator peak of a trainer rank: what `cuda_peak_gb` measures."""
        return max(self.held("step"), self.held("update"))

    @property
    def host_gb(self) -> float:
        return sum(i.host_gb for i in self.items)

    @property
    def allocator_slack_gb(self) -> float:
        """What a trainer's caching allocator reserves beyond its allocated peak (free blocks
        inside its segments): `ALLOCATOR_SLACK` of the peak, or for a LoRA trainer
        `LORA_ALLOCATOR_SLACK` of what its step adds to its resident memory. 0 for others."""
        if self.role not in TORCH_WORLDS:
            return 0.0
        if self.lora:
            return LORA_ALLOCATOR_SLACK * (self.trainer_peak - self.held("always"))
        return ALLOCATOR_SLACK * self.trainer_peak


@dataclass
class GpuPlan:
    node: int
    index: int | None  # None: placed at run time
    processes: list[PlannedProcess]
    rollout_sleeps: bool

    @property
    def label(self) -> str:
        where = f"GPU {self.index}" if self.index is not None else "a GPU picked at run time"
        return f"{where} of node {self.node}"

    def phases(self) -> dict[str, float]:
        """GB the GPU holds in each phase of the loop: contexts and the trainers'
        allocator slack (reserved beyond allocated) included."""
        context = sum(p.context_gb for p in self.processes)
        context += sum(p.allocator_slack_gb for p in self.processes)
        trainers = [p for p in self.processes if p.role in TORCH_WORLDS]
        others = [p for p in self.processes if p.role not in TORCH_WORLDS]
        if self.rollout_sleeps:
            step = sum(p.trainer_peak for p in trainers) + sum(p.held("asleep") for p in others)
            update = sum(p.held("update") for p in trainers) + sum(p.held("awake") for p in others)
            return {"trainer steps, vLLM asleep": step + context, "weight update and generation": update + context}
        total = sum(p.trainer_peak for p in trainers) + sum(p.held("awake") for p in others)
        return {"all at once": total + context}

    def largest(self) -> tuple[str, float]:
        """The largest single consumer on this GPU: (process: what, GB)."""
        best = max(((p, i) for p in self.processes for i in p.items), key=lambda pi: pi[1].gb, default=None)
        return (f"{best[0].name} {best[1].what}", best[1].gb) if best else ("nothing", 0.0)


@dataclass
class Plan:
    shape: ModelShape
    gpu_gb: float  # 0: unknown (no GPU here, memory.gpu_gb unset): nothing checked
    host_gb: float
    gpus: list[GpuPlan] = field(default_factory=list)
    host: dict[int, list[tuple[str, float]]] = field(default_factory=dict)  # node: [(what, GB)]
    notes: list[str] = field(default_factory=list)
    chosen: list[str] = field(default_factory=list)  # what `auto` became and why (memory.chosen)
    step: StepTime | None = None  # the trainer's estimated step time (a trainer on GPUs of a known size)

    def problems(self) -> Iterator[str]:
        """One line per GPU phase or host that does not fit (nothing when sizes are unknown)."""
        if self.gpu_gb:
            for g in self.gpus:
                for phase, need in g.phases().items():
                    if need > self.gpu_gb - GPU_HEADROOM_GB:
                        what, gb = g.largest()
                        yield (
                            f"{g.label} needs {need:.1f} GB ({phase}) of its {self.gpu_gb:.1f} GB "
                            f"({GPU_HEADROOM_GB:g} GB kept free); "
                            f"largest: {what} {gb:.1f} GB"
                        )
        yield from self.notes
        if self.host_gb:
            for node, rows in self.host.items():
                need = sum(gb for _, gb in rows)
                if need > self.host_gb:
                    what, gb = max(rows, key=lambda r: r[1])
                    yield (
                        f"host memory of node {node}: needs {need:.1f} GB but has {self.host_gb:.1f} GB; "
                        f"largest: {what} {gb:.1f} GB{self._largest_on_host(what)}"
                    )

    def _largest_on_host(self, name: str) -> str:
        """` (what GB)`: process `name`'s largest consumer in host memory, if it has one."""
        held = [i for g in self.gpus for p in g.processes if p.name == name for i in p.items if i.host_gb]
        best = max(held, key=lambda i: i.host_gb, default=None)
        return f" ({best.what} {best.host_gb:.1f} GB)" if best else ""

    def trainer_host_gb(self) -> float | None:
        """Trainer rank 0's estimated host memory (what `host_peak_gb` measures): what it keeps
        there (offload) and its process's own."""
        for rows in self.host.values():
            for name, gb in rows:
                if name == "trainer-0":
                    return gb
        return None

    def trainer_peak_gb(self) -> float | None:
        """Trainer rank 0's estimated allocator peak (what `cuda_peak_gb` measures)."""
        for g in self.gpus:
            for p in g.processes:
                if p.name == "trainer-0":
                    return p.trainer_peak
        return None

    def process_gb(self) -> dict[str, float]:
        """Each process planned on a GPU: the most it holds there in any phase, with its allocator
        slack and its context (what nvidia-smi counts for it, `benchmarks/gpu_process_peaks.py`);
        nothing where the GPUs' size is unknown (no GPU here, `memory.gpu_gb` unset)."""
        if not self.gpu_gb:
            return {}
        return {
            p.name: max((p.held(ph) for i in p.items for ph in i.phase.split(",")), default=0.0)
            + p.allocator_slack_gb
            + p.context_gb
            for g in self.gpus
            for p in g.processes
            if p.items or p.context_gb
        }


def build_plan(cfg: RunConfig, gpu_gb: float, host_gb: float, *, on_gpus: bool | None = None) -> Plan:
    """The plan of `cfg` on GPUs of `gpu_gb` and hosts of `host_gb` (0: unknown). `on_gpus`:
    whether the run's GPU roles get GPUs (default: the config asks for them, or `gpu_gb` is
    known); without, every role is planned in host memory."""
    shape = model_shape(cfg)
    plan = Plan(shape=shape, gpu_gb=gpu_gb, host_gb=host_gb)
    if on_gpus is None:
        on_gpus = bool(gpu_gb) or wants_gpus(cfg)
    procs = placed_processes(cfg)
    world = {role: sum(1 for p in procs if p.role == role) for role in TORCH_WORLDS}
    by_gpu: dict[tuple[int, int | None, int], list[tuple[Placed, PlannedProcess]]] = {}  # (node, GPU, alone)
    for i, proc in enumerate(procs):
        on_gpu = on_gpus and uses_gpu(cfg, proc.role) and (proc.role != "reward" or bool(proc.devices))
        planned = _plan_process(cfg, shape, proc, world, gpu_gb, procs, on_gpu)
        plan.host.setdefault(proc.node, []).append((proc.name, planned.host_gb + _own_host(cfg, proc.role, on_gpu)))
        if not on_gpu or not planned.items:
            continue
        keys: list[tuple[int, int | None, int]] = [(proc.node, d, -1) for d in proc.devices] or [(proc.node, None, i)]
        for key in keys:
            by_gpu.setdefault(key, []).append((proc, planned))
    for (node, index, _), members in sorted(by_gpu.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1, kv[0][2])):
        sleeps = any(p.role == "rollout" and rollout_sleeps(cfg, p.rank) for p, _ in members)
        plan.gpus.append(GpuPlan(node, index, [m for _, m in members], sleeps))
    trainers = [p for g in plan.gpus for p in g.processes if p.role == "trainer"]
    if gpu_gb and trainers:
        plan.step = step_time(cfg, shape, world["trainer"])
    if gpu_gb and on_gpus and any(p.role == "rollout" for p in procs):
        kv = vllm_kv_cache_gb(cfg, shape, gpu_gb)
        e = cfg.rollout.engine
        need = shape.kv_bytes_per_token() / e.tensor_parallel_size * e.max_model_len / GB
        if kv < need:
            plan.notes.append(
                f"rollout: gpu_memory_utilization {cfg.rollout.engine.gpu_memory_utilization:g} of {gpu_gb:.1f} GB "
                f"leaves vLLM {max(kv, 0.0):.1f} GB for its KV cache after the weights, less than one "
                f"{cfg.rollout.engine.max_model_len}-token sequence ({need:.2f} GB); largest: vLLM weights"
            )
    return plan


def _plan_process(
    cfg: RunConfig,
    shape: ModelShape,
    proc: Placed,
    world: dict[str, int],
    gpu_gb: float,
    procs: list[Placed],
    on_gpu: bool,
) -> PlannedProcess:
    context = CUDA_CONTEXT_GB if on_gpu else 0.0
    if proc.role in TORCH_WORLDS:
        items = trainer_memory(cfg, shape, world[proc.role], critic=proc.role == "critic")
        if proc.role == "trainer" and proc.rank == 0 and on_gpu:
            items += weight_sync_items(cfg, shape, _backend(cfg, proc, procs))
        if not on_gpu:  # all of it in host memory
            items = [Item(i.what, 0.0, i.phase, i.host_gb + i.gb) for i in items]
        if world[proc.role] > 1 or cfg.weight_sync.backend == "nccl":
            context += NCCL_GB if on_gpu else 0.0
        lora = cfg.trainer.lora.rank > 0 and proc.role == "trainer"
        return PlannedProcess(proc.name, proc.role, items, context, lora=lora)
    if proc.role == "rollout" and on_gpu:
        util = cfg.rollout.engine.gpu_memory_utilization
        if not gpu_gb:
            items = [Item(f"vLLM (gpu_memory_utilization {util:g})", 0.0, "awake")]
        else:
            items = rollout_memory(cfg, shape, gpu_gb, sleeps=rollout_sleeps(cfg, proc.rank))
        return PlannedProcess(proc.name, proc.role, items, VLLM_CONTEXT_GB if proc.devices or gpu_gb else 0.0)
    if proc.role == "reward_model" and cfg.reward.judge.model and gpu_gb and on_gpu:
        util = cfg.reward.judge.engine.gpu_memory_utilization
        items = [Item(f"judge vLLM ({util:g})", util * gpu_gb, "awake")]
        return PlannedProcess(proc.name, proc.role, items, VLLM_CONTEXT_GB)
    if proc.role == "teacher" and gpu_gb and on_gpu:
        util = cfg.algorithm.distill.engine.gpu_memory_utilization
        d = cfg.algorithm.distill
        tokens = max(d.max_batched_tokens, d.engine.max_model_len + 1)
        items = [
            Item(f"teacher vLLM ({util:g})", util * gpu_gb, "awake"),
            # full-vocabulary log-softmax of the prompt tokens of one engine step, beside vLLM's share
            Item(
                f"teacher prompt logprobs ({tokens} tokens x {shape.vocab} x 8 B)",
                tokens * shape.vocab * 8 / GB,
                "awake",
            ),
        ]
        return PlannedProcess(proc.name, proc.role, items, VLLM_CONTEXT_GB)
    return PlannedProcess(proc.name, proc.role, [], 0.0)


def _own_host(cfg: RunConfig, role: str, on_gpu: bool) -> float:
    """A process's own host memory; a vLLM on the CPU also holds its KV cache there."""
    if role != "rollout":
        return PROCESS_HOST_GB
    return PROCESS_HOST_GB + VLLM_HOST_GB + (0.0 if on_gpu else cfg.rollout.engine.cpu_kvcache_gb * 2**30 / GB)


def _backend(cfg: RunConfig, trainer0: Placed, procs: list[Placed]) -> str:
    """The weight-sync backend `auto` will pick (roles/weights/backend.py) as placement tells."""
    backend = cfg.weight_sync.backend
    if backend != "auto":
        return backend
    rollouts = [p for p in procs if p.role == "rollout"]
    if trainer0.gpus and rollouts and all(p.gpus == trainer0.gpus for p in rollouts):
        return "ipc"
    return "nccl" if trainer0.devices and all(p.devices for p in rollouts) else "zmq"


def launch_plan(cfg: RunConfig, *, asks_gpus: bool) -> Plan:
    """The plan with this machine's sizes (`plan_sizes`), headed by what `auto` chose. GPU roles
    are planned on GPUs when the config asks for them or this machine has them
    (`trainer.device: auto`). Raises ShapeError when the model's shape cannot be read."""
    gpu_gb, host_gb = plan_sizes(cfg)
    plan = build_plan(cfg, gpu_gb, host_gb, on_gpus=plans_on_gpus(cfg, gpu_gb, asks_gpus=asks_gpus))
    plan.chosen = list(cfg.memory.chosen)
    return plan


def plan_sizes(cfg: RunConfig) -> tuple[float, float]:
    """(GPU GB, host GB) to plan for: `memory.gpu_gb` / `memory.host_gb`, or the smallest GPU
    nvidia-smi reports and /proc/meminfo's total (0: unknown). A GPU size given on a machine
    without GPUs plans for another machine, whose host is unknown unless `memory.host_gb` says."""
    here = smallest_gpu_gb()
    elsewhere = bool(cfg.memory.gpu_gb) and not here
    return cfg.memory.gpu_gb or here, cfg.memory.host_gb or (0.0 if elsewhere else host_memory_gb())


def plans_on_gpus(cfg: RunConfig, gpu_gb: float, *, asks_gpus: bool) -> bool:
    """Whether the GPU roles are planned on GPUs: the config asks for them, or GPUs of a known
    size are there and the trainer may use them."""
    return asks_gpus or (bool(gpu_gb) and cfg.trainer.device != "cpu")


@functools.cache
def smallest_gpu_gb() -> float:
    """This machine's smallest GPU in GB, 0 without one; asked once per process (settling
    `auto` and the launcher's plan both plan with it)."""
    return min(gpu_totals(), default=0.0)


def host_memory_gb(meminfo: str = "/proc/meminfo") -> float:
    """This host's memory in GB; 0 where /proc/meminfo cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


# --- the check and its fix ---------------------------------------------------------------
FIXES: tuple[tuple[str, Any], ...] = (  # after halving trainer.micro_batch_tokens, in this order
    ("trainer.gradient_checkpointing", True),
    ("trainer.offload.optimizer", True),
    ("trainer.offload.params", True),
    ("fsdp.cpu_offload", True),
)


def check_plan(cfg: RunConfig, plan: Plan) -> None:
    """Raise a one-line `ConfigError` for the plan's first problem, with a fix that fits."""
    problem = next(plan.problems(), None)
    if problem is None:
        return
    fix = suggest_fix(cfg, plan.gpu_gb, plan.host_gb)
    raise ConfigError(f"memory plan: {problem}; {fix} (tandem launch --plan shows the plan; memory.check=false skips)")


def suggest_fix(cfg: RunConfig, gpu_gb: float, host_gb: float) -> str:
    """The first setting (or pair) that makes the plan fit, as `key=value` advice."""
    candidates: list[tuple[str, Any]] = []
    mbt = cfg.trainer.micro_batch_tokens
    while mbt // 2 >= cfg.rollout.engine.max_model_len and len(candidates) < 2:
        mbt //= 2
        candidates.append(("trainer.micro_batch_tokens", mbt))
    candidates += [(k, v) for k, v in FIXES if _get(cfg, k) != v and _applies(cfg, k)]
    util = round(cfg.rollout.engine.gpu_memory_utilization - 0.05, 2)
    while util >= 0.1:
        candidates.append(("rollout.engine.gpu_memory_utilization", util))
        util = round(util - 0.05, 2)
    for changes in [[c] for c in candidates] + [[a, b] for a in candidates[:3] for b in candidates if b[0] != a[0]]:
        trial = _with(cfg, changes)
        if trial is not None and next(build_plan(trial, gpu_gb, host_gb).problems(), None) is None:
            return "it fits with " + " ".join(f"{k}={_text(v)}" for k, v in changes)
    return "no single setting makes it fit: place the roles on more GPUs, or train adapters (trainer.lora.rank=16)"


def _applies(cfg: RunConfig, key: str) -> bool:
    if key == "trainer.offload.params":
        return any(p.role == "rollout" and rollout_sleeps(cfg, p.rank) for p in placed_processes(cfg))
    if key == "fsdp.cpu_offload":  # in place of trainer.offload (runtime/config/validate.py refuses both)
        off = cfg.trainer.offload
        return cfg.trainer.backend == "fsdp" and cfg.trainer.device != "cpu" and not (off.optimizer or off.params)
    return cfg.trainer.backend == "fsdp" or not key.startswith("trainer.offload")


def _get(cfg: RunConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _with(cfg: RunConfig, changes: list[tuple[str, Any]]) -> RunConfig | None:
    data = msgspec.to_builtins(cfg)
    for dotted, value in changes:
        *parents, last = dotted.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value
    try:
        return msgspec.convert(data, RunConfig)
    except msgspec.ValidationError:
        return None


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# --- the table -------------------------------------------------------------------------
def format_plan(plan: Plan) -> str:
    """The plan as a table (GB = 10^9 bytes), one block per GPU and one per host."""
    s = plan.shape
    size = f"{plan.gpu_gb:.1f} GB GPUs" if plan.gpu_gb else "GPU size unknown (memory.gpu_gb=N sets it)"
    moe = (
        f", mixture of {s.experts} experts ({s.experts_per_tok} a token: {count_text(s.active_params)} active)"
        if s.moe
        else ""
    )
    lines = [
        f"memory plan: {count_text(s.num_params)}-parameter policy (hidden {s.hidden}, {s.layers} layers, "
        f"vocabulary {s.vocab}{moe}), {size}, GB = 10^9 bytes"
    ]
    lines += [f"auto: {c}" for c in plan.chosen]
    for g in plan.gpus:
        names = ", ".join(p.name for p in g.processes)
        sleep = "; vLLM sleeps while the trainer steps" if g.rollout_sleeps else ""
        lines.append(f"{g.label}: {names}{sleep}")
        for p in g.processes:
            for i in p.items:
                if i.gb or not i.host_gb:
                    lines.append(f"  {p.name:<12} {i.what:<52} {i.gb:7.1f}  {i.phase}")
            if p.role in TORCH_WORLDS:
                lines.append(f"  {p.name:<12} {'peak (cuda_peak_gb)':<52} {p.trainer_peak:7.1f}")
                slack = "allocator's free blocks beside it" + (" (LoRA)" if p.lora else "")
                lines.append(f"  {p.name:<12} {slack:<52} {p.allocator_slack_gb:7.1f}")
            if p.context_gb:
                lines.append(f"  {p.name:<12} {'CUDA context, NCCL (outside the allocator)':<52} {p.context_gb:7.1f}")
        for phase, need in g.phases().items():
            fits = need <= plan.gpu_gb - GPU_HEADROOM_GB
            verdict = ("fits" if fits else "DOES NOT FIT") if plan.gpu_gb else "unchecked"
            have = f" of {plan.gpu_gb:.1f}" if plan.gpu_gb else ""
            lines.append(f"  = {phase}: {need:.1f}{have} GB, {verdict}")
    for node, rows in plan.host.items():
        need = sum(gb for _, gb in rows)
        offloaded = [
            f"{p.name} {i.what} {i.host_gb:.1f}" for g in plan.gpus for p in g.processes for i in p.items if i.host_gb
        ]
        have = f" of {plan.host_gb:.1f}" if plan.host_gb else ""
        verdict = ("fits" if need <= plan.host_gb else "DOES NOT FIT") if plan.host_gb else "unchecked"
        extra = f" (in it: {'; '.join(offloaded)})" if offloaded else ""
        lines.append(f"host of node {node}: {need:.1f}{have} GB, {verdict}{extra}")
    if plan.step is not None:
        lines.append(plan.step.line())
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_summary(plan: Plan) -> str:
    """One line: each GPU's phases in GB of its size (the console's, at a run's start)."""
    parts = []
    for g in plan.gpus:
        if any(p.role != "reward" for p in g.processes):
            phases = ", ".join(f"{phase} {need:.1f}" for phase, need in g.phases().items())
            parts.append(f"{g.label}: {phases}")
    return f"memory plan ({plan.gpu_gb:.1f} GB GPUs): " + "; ".join(parts) + " GB (tandem launch --plan: the table)"


def plan_rows(plan: Plan) -> list[dict[str, Any]]:
    """The plan as log fields: one row per GPU phase and per host."""
    rows: list[dict[str, Any]] = []
    for g in plan.gpus:
        for phase, need in g.phases().items():
            rows.append({"gpu": g.label, "phase": phase, "gb": round(need, 2), "largest": g.largest()[0]})
    for node, items in plan.host.items():
        rows.append({"host": node, "gb": round(sum(gb for _, gb in items), 2)})
    return rows
