"""`auto` settings: for the GPUs of this machine (or `memory.gpu_gb`), the fastest combination
the memory plan (runtime/memory/plan.py) says fits.

`load_settled` (what `tandem launch` loads a recipe with) reads the config and hands `settle` the
keys a recipe set to `auto` or left out (`AUTO_KEYS`, runtime/config/load.py); whatever reads the
config afterwards sees plain values, and `memory.chosen` says what each key became and why. What each becomes:

* `rollout.engine.gpu_memory_utilization`: what vLLM's weights, its workspace and a KV cache of
  `max_num_seqs` sequences of `max_model_len` tokens need, no more: a larger share would hold
  cache no step can use, so the rest of the GPU goes to the trainer;
* `trainer.micro_batch_tokens`: the largest power of two that fits, up to `MAX_MICRO_BATCH` and
  to one micro-batch per rank and optimizer step;
* `rollout.engine.sleep_when_idle`: on only where the trainer's step does not fit beside an
  awake vLLM (a synchronous colocated run: sleeping and waking cost time every step);
* `rollout.engine.sleep_level`: 2 (the weights are discarded: the next update replaces them),
  1 when the trainer trains LoRA adapters (their updates keep the base weights);
* `trainer.offload.optimizer`, `trainer.offload.params`: on only where nothing fits without;
* `fsdp.cpu_offload` (FSDP2's full offload: master weights, gradients and AdamW in host memory,
  the optimizer step on the CPU): the last lever, where nothing else fits.

The levers that trade speed for memory are tried in this order, each with the largest micro-
batch that fits: none; vLLM asleep; half of vLLM's KV cache (awake, then asleep); optimizer
offload (the same four); optimizer and parameter offload (asleep, whole then half KV cache);
FSDP2's full offload (the same four as the first). Under full offload every micro-batch's
gradients go to the host, so its micro-batches may grow past `MAX_MICRO_BATCH`, up to a rank's
share of a step.
Micro-batches below `FAST_MICRO_BATCH` tokens are tried only after every lever failed with
larger ones: they cost more than any lever. Keys given a value are kept as given (the launch
check plans them). Where no GPU size is known (`memory.chosen` stays empty), no trainer or
rollout is planned on a GPU, or the model's shape cannot be read, the `auto` keys keep
`RunConfig()`'s values (the CPU values). Where nothing fits, the last combination (the most
frugal) is kept, and the launch check refuses it in one line naming the largest consumer.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from runtime.config import RunConfig
from runtime.config.load import AUTO_KEYS, read_config, unset_keys
from runtime.config.placement import placed_processes, rollout_shares_trainer_gpu, wants_gpus
from runtime.memory.estimate import GB, VLLM_WORKSPACE_GB, ModelShape, ShapeError, model_shape, vllm_weights_gb
from runtime.memory.plan import GPU_HEADROOM_GB, Plan, build_plan, plan_sizes, plans_on_gpus

MICRO = "trainer.micro_batch_tokens"
SHARE = "rollout.engine.gpu_memory_utilization"
SLEEP = "rollout.engine.sleep_when_idle"
LEVEL = "rollout.engine.sleep_level"
OPTIMIZER = "trainer.offload.optimizer"
PARAMS = "trainer.offload.params"
FULL = "fsdp.cpu_offload"
# Past this a micro-batch's fixed costs are a few % of its compute (benchmarks/trainer.py: 6N MFU
# within 2 points from 1k to 4k tokens), while its activations grow with it: the memory is worth
# more as room for the allocator's cache, and the plan counts the budget, not the tokens that fill it.
MAX_MICRO_BATCH = 16384
# Below this a micro-batch costs more than any lever: the 3.09B recipe on one H100 at 1024-token
# micro-batches (no offload, vLLM awake) trained at 6.6 % MFU, 19 s a step, where sleeping vLLM
# or streaming the optimizer's moments costs about a second. The search tries every lever with
# micro-batches of at least this many tokens before it goes below.
FAST_MICRO_BATCH = 4096


@dataclass(frozen=True)
class Levers:
    """One combination of the settings that trade speed for memory."""

    sleep: bool
    optimizer: bool
    params: bool
    kv_half: bool
    full: bool = False  # FSDP2's full offload (fsdp.cpu_offload)

    def cost(self) -> tuple[bool, bool, bool, bool, bool]:
        """Sort key, cheapest first: full offload costs most (the optimizer steps on the CPU and
        every micro-batch's gradients cross to the host), then parameter offload, then optimizer
        offload, then half of vLLM's KV cache, then sleeping."""
        return (self.full, self.params, self.optimizer, self.kv_half, self.sleep)


def load_settled(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:  # type: ignore[assignment]
    """`load_config(path, overrides)` with its `auto` keys settled for this machine (or
    `memory.gpu_gb`); a recipe that leaves a key `???` is returned unsettled (the chooser plans
    for the model: it waits until `model.path` is given, and `check_set` refuses it)."""
    cfg, auto = read_config(path, overrides)
    if auto and not unset_keys(cfg):
        cfg = settle(cfg, auto)
    return cfg


def settle(cfg: RunConfig, auto: list[str]) -> RunConfig:
    """`cfg` with a value for every key in `auto` (dotted names from `AUTO_KEYS`) and
    `memory.chosen` saying what each became and why, planned for `memory.gpu_gb` /
    `memory.host_gb` or this machine's GPUs and host."""
    gpu_gb, host_gb = plan_sizes(cfg)
    settled, lines = choose(cfg, auto, gpu_gb, host_gb)
    return replace(settled, "memory.chosen", lines)


def choose(cfg: RunConfig, auto: list[str], gpu_gb: float, host_gb: float) -> tuple[RunConfig, list[str]]:
    """`cfg` with the `auto` keys set for GPUs of `gpu_gb` and hosts of `host_gb` (0: unknown),
    and one line per key (its value and why). Never raises for a config that does not fit."""
    keys = [k for k in AUTO_KEYS if k in auto]
    if not keys:
        return cfg, []
    if not gpu_gb:  # a CPU run, or a plan without a GPU size: as before `auto`, nothing to say
        return cfg, []
    try:
        shape = model_shape(cfg)
    except ShapeError as exc:
        return cfg, [_kept(cfg, keys, f"no memory plan ({exc})")]
    on_gpus = plans_on_gpus(cfg, gpu_gb, asks_gpus=wants_gpus(cfg))
    roles = {p.role for g in build_plan(cfg, gpu_gb, host_gb, on_gpus=on_gpus).gpus for p in g.processes}
    if not roles & {"trainer", "rollout"}:
        return cfg, [_kept(cfg, keys, "no trainer or rollout is planned on a GPU")]
    return _Search(cfg, set(keys), shape, gpu_gb, host_gb, on_gpus, roles).run()


@dataclass
class _Search:
    cfg: RunConfig
    auto: set[str]
    shape: ModelShape
    gpu_gb: float
    host_gb: float
    on_gpus: bool
    roles: set[str]  # the roles planned on a GPU

    def run(self) -> tuple[RunConfig, list[str]]:
        """The first combination (in `Levers.cost` order) and micro-batch that fits, else the
        most frugal; with the lines that say why."""
        levers = self.levers()
        floor = min(FAST_MICRO_BATCH, self.micro_batches()[0])
        for fast in (True, False):  # a lever before a micro-batch below the floor; then the rest
            for lv in levers:
                for tokens in self.micro_batches(lv.full):
                    if (tokens >= floor) != fast:
                        continue
                    trial = self.trial(lv, tokens)
                    if self.fits(trial):
                        return trial, self.lines(trial, lv, tokens, fitted=True)
        smallest = self.micro_batches(levers[-1].full)[-1]
        trial = self.trial(levers[-1], smallest)
        return trial, self.lines(trial, levers[-1], smallest, fitted=False)

    def levers(self) -> list[Levers]:
        """Every combination the `auto` keys allow, cheapest first; explicit keys stay as given."""
        c, off = self.cfg, self.cfg.trainer.offload
        sleep = self._options(SLEEP, c.rollout.engine.sleep_when_idle, self.can_sleep())
        optimizer = self._options(OPTIMIZER, off.optimizer, self.can_offload())
        params = self._options(PARAMS, off.params, self.can_offload())
        kv_half = [False, True] if SHARE in self.auto and "rollout" in self.roles else [False]
        full = self._options(FULL, self.cfg.fsdp.cpu_offload, self.can_offload_fully())
        combos = [Levers(*x) for x in itertools.product(sleep, optimizer, params, kv_half, full)]
        # Parameter offload frees the GPU only while vLLM sleeps (runtime/config/validate.py refuses it otherwise).
        combos = [lv for lv in combos if lv.sleep or not lv.params or PARAMS not in self.auto]
        # FSDP2's full offload replaces trainer.offload (runtime/config/validate.py refuses both).
        combos = [lv for lv in combos if not (lv.full and (lv.optimizer or lv.params))]
        return sorted(combos, key=Levers.cost)

    def _options(self, key: str, given: bool, possible: bool) -> list[bool]:
        if key not in self.auto:
            return [given]
        return [False, True] if possible else [False]

    def can_sleep(self) -> bool:
        """Whether a rollout could sleep: a synchronous run with a rollout on a trainer's GPU,
        training the full model."""
        if self.cfg.trainer.lora.rank and self.cfg.trainer.device == "cuda":
            return False  # vLLM's wake-up after an adapter update fails on the GPU (runtime/config/validate.py)
        rollouts = [p.rank for p in placed_processes(self.cfg) if p.role == "rollout"]
        return self.cfg.rollout.max_staleness == 0 and any(rollout_shares_trainer_gpu(self.cfg, r) for r in rollouts)

    def can_offload(self) -> bool:
        """Whether `trainer.offload` could act (runtime/config/validate.py's conditions)."""
        t = self.cfg.trainer
        fused = t.optim.implementation == "fused"
        return "trainer" in self.roles and t.backend == "fsdp" and not self.cfg.fsdp.cpu_offload and not fused

    def can_offload_fully(self) -> bool:
        """Whether FSDP2's full offload could act: the FSDP2 actor on a GPU training every
        parameter, `trainer.offload` not given on. Not with LoRA adapters: FSDP2's offload of a
        frozen base beside vLLM's adapters has not run on a GPU, so auto leaves it to be asked for."""
        t = self.cfg.trainer
        given = {OPTIMIZER: t.offload.optimizer, PARAMS: t.offload.params}
        kept_off = not any(on for key, on in given.items() if key not in self.auto)
        gpu = "trainer" in self.roles and t.device != "cpu"
        return gpu and t.backend == "fsdp" and not t.lora.rank and kept_off

    def micro_batches(self, full: bool = False) -> list[int]:
        """Powers of two, largest first: from the first that holds one rank's share of an
        optimizer step (at most `MAX_MICRO_BATCH`, unless `full`: FSDP2's full offload copies
        every micro-batch's gradients to the host) down to the first that holds the longest sequence."""
        if MICRO not in self.auto or "trainer" not in self.roles:
            return [self.cfg.trainer.micro_batch_tokens]
        t, longest = self.cfg.trainer, self.cfg.rollout.engine.max_model_len
        ranks = sum(1 for p in placed_processes(self.cfg) if p.role == "trainer") or 1
        step = math.ceil(t.prompts_per_step * self.cfg.rollout.n * longest / ranks / t.mini_batches)
        low = _log2_up(longest)
        high = max(low, _log2_up(step) if full else min(_log2_up(step), _log2_up(MAX_MICRO_BATCH)))
        return [1 << k for k in range(high, low - 1, -1)]

    def share(self, kv_half: bool) -> float:
        """vLLM's fraction of the GPU: weights, workspace and KV cache (see the module docstring)."""
        need = vllm_weights_gb(self.cfg, self.shape) + VLLM_WORKSPACE_GB + self.kv_gb(kv_half)
        return min(0.99, max(0.05, math.ceil(need / self.gpu_gb * 100) / 100))

    def kv_gb(self, kv_half: bool) -> float:
        e = self.cfg.rollout.engine
        sequences = e.max_num_seqs // 2 if kv_half else e.max_num_seqs
        return self.shape.kv_bytes_per_token() / e.tensor_parallel_size * e.max_model_len * sequences / GB

    def trial(self, lv: Levers, tokens: int) -> RunConfig:
        values: dict[str, Any] = {
            SLEEP: lv.sleep,
            OPTIMIZER: lv.optimizer,
            PARAMS: lv.params,
            FULL: lv.full,
            MICRO: tokens,
            LEVEL: 1 if self.cfg.trainer.lora.rank else 2,
        }
        if "rollout" in self.roles:
            values[SHARE] = self.share(lv.kv_half)
        cfg = self.cfg
        for key in self.auto & values.keys():
            cfg = replace(cfg, key, values[key])
        return cfg

    def plan(self, cfg: RunConfig) -> Plan:
        return build_plan(cfg, self.gpu_gb, self.host_gb, on_gpus=self.on_gpus)

    def fits(self, cfg: RunConfig) -> bool:
        return next(self.plan(cfg).problems(), None) is None

    def lines(self, cfg: RunConfig, lv: Levers, tokens: int, *, fitted: bool) -> list[str]:
        """One line per `auto` key: its value and why (`fitted`: this combination fits)."""
        why = {
            MICRO: self._why_micro(lv, tokens) if fitted else "the smallest tried",
            SHARE: self._why_share(lv.kv_half),
            SLEEP: self._why_sleep(lv.sleep) if fitted else "",
            LEVEL: self._why_level(lv.sleep),
            OPTIMIZER: self._why_offload(lv, lv.optimizer, "AdamW's moments") if fitted else "",
            PARAMS: self._why_offload(lv, lv.params, "the master weights") if fitted else "",
            FULL: self._why_full(lv.full) if fitted else "",
        }
        out = [] if fitted else [f"nothing fits on {self.gpu_gb:.1f} GB GPUs; planned with the most frugal settings"]
        for key in AUTO_KEYS:
            if key in self.auto:
                out.append(f"{key}={_text(_get(cfg, key))}" + (f": {why[key]}" if why[key] else ""))
        return out

    def _why_micro(self, lv: Levers, tokens: int) -> str:
        if MICRO not in self.auto or "trainer" not in self.roles:
            return "the trainer is not on a GPU (the CPU value)"
        if tokens == MAX_MICRO_BATCH and not lv.full:
            return "the most auto takes"
        if tokens == self.micro_batches(lv.full)[0]:
            return "one micro-batch holds a rank's share of a step"
        need, phase = _worst(self.plan(self.trial(lv, tokens * 2)))
        usable = self.gpu_gb - GPU_HEADROOM_GB
        return f"the largest that fits ({tokens * 2} needs {need:.1f} of {usable:.1f} GB, {phase})"

    def _why_share(self, kv_half: bool) -> str:
        if "rollout" not in self.roles:
            return "vLLM is not on a GPU (the CPU value)"
        e = self.cfg.rollout.engine
        sequences = e.max_num_seqs // 2 if kv_half else e.max_num_seqs
        half = "; half of max_num_seqs: the whole cache does not fit" if kv_half else ""
        weights = vllm_weights_gb(self.cfg, self.shape)
        return (
            f"vLLM's weights {weights:.1f} GB, workspace {VLLM_WORKSPACE_GB:g} GB and a KV cache of "
            f"{sequences} x {e.max_model_len} tokens {self.kv_gb(kv_half):.1f} GB{half}"
        )

    def _why_sleep(self, sleep: bool) -> str:
        if sleep:
            return "the trainer's step does not fit beside an awake vLLM"
        if self.can_sleep():
            return "the trainer's step fits beside an awake vLLM (no sleep and wake each step)"
        if self.cfg.trainer.lora.rank and self.cfg.rollout.max_staleness == 0:
            return "vLLM stays awake under LoRA (its wake-up after an adapter update fails on the GPU)"
        return "vLLM never waits for the trainer here (asynchronous, or on a GPU of its own)"

    def _why_level(self, sleep: bool) -> str:
        if not sleep:
            return "vLLM does not sleep"
        if self.cfg.trainer.lora.rank:
            return "LoRA updates keep the base weights, so a sleeping vLLM keeps them in host memory"
        return "a sleeping vLLM discards its weights (the next update replaces them)"

    def _why_offload(self, lv: Levers, on: bool, what: str) -> str:
        if on:
            return "nothing cheaper fits"
        if lv.full:
            return "FSDP2's full offload (fsdp.cpu_offload) keeps them in host memory instead"
        return f"it fits with {what} on the GPU" if self.can_offload() else "it would not act here"

    def _why_full(self, on: bool) -> str:
        if on:
            return (
                "nothing else fits: master weights, gradients and AdamW in host memory, the optimizer "
                "step on the CPU (slow: the trainer step line below says how slow)"
            )
        return "it fits without FSDP2's full offload" if self.can_offload_fully() else "it would not act here"


def pins(cfg: RunConfig) -> list[str]:
    """`key=value` overrides holding `cfg`'s values of every `AUTO_KEYS` key: a benchmark gives
    them to each variant it compares, so all run with one variant's choice."""
    return [f"{key}={_text(_get(cfg, key))}" for key in AUTO_KEYS]


def replace(cfg: Any, dotted: str, value: Any) -> Any:
    """A copy of `cfg` with the dotted key set to `value` (not validated: the caller's values are)."""
    head, _, rest = dotted.partition(".")
    inner = replace(getattr(cfg, head), rest, value) if rest else value
    return msgspec.structs.replace(cfg, **{head: inner})


def _worst(plan: Plan) -> tuple[float, str]:
    """The plan's largest need of any GPU phase: (GB, phase)."""
    return max(((need, phase) for g in plan.gpus for phase, need in g.phases().items()), default=(0.0, "none"))


def _kept(cfg: RunConfig, keys: list[str], why: str) -> str:
    return ", ".join(f"{k}={_text(_get(cfg, k))}" for k in keys) + f": {why}; the CPU values"


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def _log2_up(n: int) -> int:
    """The exponent of the smallest power of two >= n."""
    return max(0, n - 1).bit_length()
