"""Cross-field checks of a config, run before any process starts.

Each failed check is a `ConfigError` with one line naming the keys involved.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os

import msgspec

from runtime.config import RunConfig
from runtime.config.load import ConfigError
from runtime.config.lora_settings import VLLM_LORA_RANKS, engine_lora_rank
from runtime.launch.placement import role_counts
from runtime.preflight.ecosystem import check_ecosystem
from runtime.preflight.gpus import (
    check_gpu_memory,
    check_ipc_weight_sync,
    check_nccl_weight_sync,
    placed_processes,
    rollout_sleeps,
)
from runtime.preflight.teacher import check_distill
from runtime.preflight.wandb_login import wandb_login_problem
from runtime.user_functions import load_env_factory, load_function, load_reward_function


def _check_fsdp_gpu_option(cfg: RunConfig, setting: str, gpu_only: str) -> None:
    """`setting` (e.g. "trainer.kernels=liger") is a GPU kernel of the FSDP actor: refuse it
    on Megatron and on a CPU trainer, `gpu_only` saying why."""
    if cfg.trainer.backend != "fsdp":
        raise ConfigError(f"{setting} applies to the FSDP actor only; trainer.backend is megatron")
    if cfg.trainer.device == "cpu":
        raise ConfigError(f"{setting} needs trainer.device=cuda ({gpu_only})")


def _check_kernels(cfg: RunConfig) -> None:
    """`trainer.kernels=liger`: Triton kernels for the FSDP actor, so CUDA and the package,
    and no `trainer.compile` (which cannot trace them)."""
    if cfg.trainer.kernels != "liger":
        return
    _check_fsdp_gpu_option(cfg, "trainer.kernels=liger", "Liger Kernel's kernels run on GPUs only")
    if cfg.trainer.compile is True:  # measured on the H200: an AssertionError inside dynamo
        raise ConfigError(
            "trainer.kernels=liger cannot run with trainer.compile=true (dynamo fails on Liger's RMSNorm "
            "autograd.Function, torch 2.11; Liger-Kernel issue #174): set one of them back"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("trainer.kernels=liger needs the liger-kernel package (pip install liger-kernel)")


def _check_attention_kernel(cfg: RunConfig) -> None:
    """`trainer.attention_kernel=fa4|cudnn`: flash-attn-4's or cuDNN's CUDA kernels in the packed FSDP actor."""
    kernel = cfg.trainer.attention_kernel
    if kernel == "torch":
        return
    option = f"trainer.attention_kernel={kernel}"
    _check_fsdp_gpu_option(cfg, option, "its kernels run on GPUs only")
    if not cfg.trainer.packing:
        raise ConfigError(f"{option} needs trainer.packing=true (it is the packed varlen kernel)")
    if kernel == "cudnn":
        import torch  # only for this option: the launcher's checks stay torch-free otherwise

        version = torch.backends.cudnn.version() if torch.cuda.is_available() else 90000  # checked where it runs
        if not version or version < 90000:
            has = f"cuDNN {version}" if version else "no cuDNN"
            raise ConfigError(f"{option} needs cuDNN 9 or later (this torch has {has})")
        return
    try:
        importlib.metadata.distribution("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        msg = "trainer.attention_kernel=fa4 needs the flash-attn-4 package (pip install flash-attn-4)"
        raise ConfigError(msg) from None


def check_config(cfg: RunConfig) -> None:
    counts = role_counts(cfg)
    check_ecosystem(cfg)  # optional extras, verifiers environments, agents (runtime/preflight/ecosystem.py)
    check_inert_options(cfg)
    _check_lora(cfg)
    _check_offload(cfg)
    _check_kernels(cfg)
    _check_attention_kernel(cfg)
    _check_megatron(cfg, counts.get("trainer", 0))
    _check_moe(cfg)
    _check_megatron_critic(cfg, counts.get("critic", 0))
    if cfg.data.source == "file" and not cfg.data.path:
        raise ConfigError("data.source=file needs data.path (a JSONL or Parquet file)")
    if cfg.data.path and cfg.data.source != "file":
        raise ConfigError(
            f"data.path is set but data.source is {cfg.data.source} (it would be ignored): add data.source=file"
        )
    if not counts.get("reward", 0) and _differs_from_default(cfg.reward, "functions") and cfg.reward.functions:
        raise ConfigError(
            "reward.functions is set but placement has no reward role (they would never run): "
            "add {role: reward} to placement"
        )
    _check_needs_gpu(cfg)
    _check_loggers(cfg)
    v = cfg.validation
    if v.every and not v.data:
        raise ConfigError("validation.every needs validation.data (a JSONL or Parquet file, or synthetic)")
    if v.n > cfg.rollout.engine.max_num_seqs:
        raise ConfigError(
            f"validation.n ({v.n}) must not exceed rollout.engine.max_num_seqs ({cfg.rollout.engine.max_num_seqs})"
        )
    if v.max_tokens >= cfg.rollout.engine.max_model_len:
        raise ConfigError(
            f"validation.max_tokens ({v.max_tokens}) must be below "
            f"rollout.engine.max_model_len ({cfg.rollout.engine.max_model_len})"
        )
    if cfg.rollout.max_tokens >= cfg.rollout.engine.max_model_len:
        raise ConfigError(
            f"rollout.max_tokens ({cfg.rollout.max_tokens}) must be below "
            f"rollout.engine.max_model_len ({cfg.rollout.engine.max_model_len})"
        )
    if cfg.rollout.length_mix_min > cfg.rollout.max_tokens:
        raise ConfigError(
            f"rollout.length_mix_min ({cfg.rollout.length_mix_min}) must not exceed "
            f"rollout.max_tokens ({cfg.rollout.max_tokens})"
        )
    _check_length_dist(cfg)
    group_estimators = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
    distilling_only = cfg.algorithm.distill.enabled and cfg.algorithm.distill.reward == "replace"  # no task advantage
    if cfg.algorithm.advantage in group_estimators and cfg.rollout.n < 2 and not distilling_only:
        raise ConfigError(
            f"algorithm.advantage={cfg.algorithm.advantage} needs rollout.n >= 2 (a group of one has no baseline "
            "and gets advantage 0); use reinforce_pp or gae with rollout.n=1"
        )
    if cfg.reward.overlong.enabled and cfg.reward.overlong.buffer > cfg.rollout.max_tokens:
        raise ConfigError(
            f"reward.overlong.buffer ({cfg.reward.overlong.buffer}) must not exceed rollout.max_tokens "
            f"({cfg.rollout.max_tokens})"
        )
    if cfg.algorithm.filter_groups and cfg.rollout.n < 2:
        raise ConfigError("algorithm.filter_groups needs rollout.n >= 2 (a group of one always has equal rewards)")
    if cfg.algorithm.advantage != "gae" and counts.get("critic", 0):
        raise ConfigError("placement has a critic but algorithm.advantage is not gae")
    kl = cfg.algorithm.kl
    if kl.enabled and kl.use == "reward" and cfg.algorithm.advantage != "gae":
        raise ConfigError(
            "algorithm.kl.use=reward needs algorithm.advantage=gae (the critic holds the reference policy); "
            "use algorithm.kl.use=loss with grpo/rloo/reinforce_pp"
        )
    if (cfg.checkpoint.every or cfg.checkpoint.final) and not cfg.checkpoint.export_hf:
        raise ConfigError(
            "checkpoint.export_hf=false: rollouts resume from the HF export; keep it true to checkpoint "
            "(or checkpoint nothing: checkpoint.every=0 checkpoint.final=false)"
        )
    for fn in cfg.reward.functions:
        if ":" not in fn:
            raise ConfigError(f"reward.functions entry '{fn}' must be module:function")
        try:
            load_reward_function(fn)  # importable, and callable with the reward arguments
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _check_env(cfg)
    _check_reward_model(cfg, counts.get("reward_model", 0))
    check_distill(cfg, counts.get("teacher", 0))
    # Only the memory budget here: device indices need the real GPU count (the launcher checks them).
    check_gpu_memory(cfg)
    check_nccl_weight_sync(cfg)
    check_ipc_weight_sync(cfg)


def _check_length_dist(cfg: RunConfig) -> None:
    dist, cap = cfg.rollout.length_dist, cfg.rollout.max_tokens
    if dist.kind == "off":
        return
    if cfg.rollout.length_mix_min:
        raise ConfigError(
            "rollout.length_dist and rollout.length_mix_min both set a budget per group: set one of them "
            "(rollout.length_mix_min=0 or rollout.length_dist.kind=off)"
        )
    if dist.min_tokens > cap:
        raise ConfigError(
            f"rollout.length_dist.min_tokens ({dist.min_tokens}) must not exceed rollout.max_tokens ({cap})"
        )
    if not dist.min_tokens <= dist.mean_tokens <= cap:
        raise ConfigError(
            f"rollout.length_dist.mean_tokens ({dist.mean_tokens}) must lie in [rollout.length_dist.min_tokens "
            f"({dist.min_tokens}), rollout.max_tokens ({cap})]"
        )


def check_inert_options(cfg: RunConfig) -> None:
    """Refuse an option set away from its default where the chosen mode ignores it, so that
    setting it never silently changes nothing. "Set" means "differs from the field's
    default": an option written with its default value passes."""
    loss, rc, a = cfg.trainer.loss, cfg.trainer.loss.rollout_correction, cfg.algorithm
    ld = cfg.rollout.length_dist
    inert = [
        ("trainer.loss.clip_ratio_c", loss, "clip_ratio_c", loss.mode != "dual-clip",
         f"it acts only with trainer.loss.mode=dual-clip (mode is {loss.mode})"),
        ("trainer.loss.importance_cap", loss, "importance_cap", rc.mode == "mask",
         "it acts only with trainer.loss.rollout_correction.mode=truncate (mode is mask: see mask_low/mask_high)"),
        ("trainer.loss.rollout_correction.mask_low", rc, "mask_low", rc.mode != "mask",
         "it acts only with trainer.loss.rollout_correction.mode=mask (mode is truncate: see importance_cap)"),
        ("trainer.loss.rollout_correction.mask_high", rc, "mask_high", rc.mode != "mask",
         "it acts only with trainer.loss.rollout_correction.mode=mask (mode is truncate: see importance_cap)"),
        ("trainer.loss.norm_tokens", loss, "norm_tokens", loss.agg != "seq-mean-token-sum-norm",
         f"it acts only with trainer.loss.agg=seq-mean-token-sum-norm (agg is {loss.agg})"),
        ("algorithm.std", a, "std", a.advantage != "grpo" or not a.norm_by_std,
         f"it acts only with algorithm.advantage=grpo and algorithm.norm_by_std=true "
         f"(advantage is {a.advantage}, norm_by_std {str(a.norm_by_std).lower()})"),
        ("algorithm.norm_by_std", a, "norm_by_std", a.advantage != "grpo",
         f"it acts only with algorithm.advantage=grpo (advantage is {a.advantage})"),
        ("algorithm.gamma", a, "gamma", a.advantage not in ("gae", "reinforce_pp"),
         f"it acts only with algorithm.advantage=gae or reinforce_pp (advantage is {a.advantage})"),
        ("algorithm.lam", a, "lam", a.advantage != "gae",
         f"it acts only with algorithm.advantage=gae (advantage is {a.advantage})"),
        ("algorithm.whiten_advantages", a, "whiten_advantages", a.advantage != "gae",
         f"it acts only with algorithm.advantage=gae (advantage is {a.advantage})"),
        *((f"rollout.length_dist.{f}", ld, f, ld.kind == "off", "it acts only with rollout.length_dist.kind=lognormal")
          for f in ("mean_tokens", "sigma", "min_tokens")),
        ("trainer.optim.implementation", cfg.trainer.optim, "implementation", cfg.trainer.backend == "megatron",
         "it acts only on the FSDP engines (Megatron steps its own distributed optimizer)"),
        ("critic.optim.implementation", cfg.critic.optim, "implementation", cfg.critic.backend == "megatron",
         "it acts only on the FSDP engines (Megatron steps its own distributed optimizer)"),
    ]  # fmt: skip
    for key, struct, field, ignored, why in inert:
        if ignored and _differs_from_default(struct, field):
            raise ConfigError(f"{key}={_fmt(getattr(struct, field))} has no effect: {why}; remove it")


def _differs_from_default(struct: msgspec.Struct, name: str) -> bool:
    field = next(f for f in msgspec.structs.fields(struct) if f.name == name)
    default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    return bool(getattr(struct, name) != default)


def _fmt(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def gpus_present() -> bool:
    """Whether this machine shows a GPU to its processes, asked without importing torch
    (a device node, and CUDA_VISIBLE_DEVICES not emptied)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def _check_needs_gpu(cfg: RunConfig) -> None:
    """Options that work only on a GPU, refused at once on a machine without one (else the
    run hangs or fails only once every role has started)."""
    if cfg.trainer.device == "cpu" or any(p.devices for p in placed_processes(cfg)) or gpus_present():
        return  # named GPUs are checked against the machine's by the launcher, before the model is made
    if cfg.weight_sync.backend == "ipc":
        raise ConfigError(
            "weight_sync.backend=ipc needs a GPU (CUDA IPC) and this machine has none: "
            "use weight_sync.backend=zmq or auto"
        )
    if cfg.fsdp.cpu_offload:
        raise ConfigError(
            "fsdp.cpu_offload=true needs a GPU (it offloads from one) and this machine has none: set it false"
        )


def policy_experts(cfg: RunConfig) -> int:
    """Experts per layer of the policy (0: a dense model), from `model.path`'s config.json or
    `model.tiny` (an unreadable config.json counts as dense: the model checks say why)."""
    if not cfg.model.path or cfg.model.path == "tiny":
        return cfg.model.tiny.num_experts
    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return 0
    return int(c.get("num_experts") or c.get("num_local_experts") or 0) if isinstance(c, dict) else 0


def _check_moe(cfg: RunConfig) -> None:
    """Mixture-of-experts policies train on the FSDP2 actor, full-parameter, eager; routing
    replay needs one, and vLLM on a GPU to report the routing."""
    experts = policy_experts(cfg)
    replay = cfg.algorithm.routing_replay
    if replay != "disabled" and not experts:
        raise ConfigError(
            f"algorithm.routing_replay={replay} needs a mixture-of-experts policy; the policy is dense "
            "(no num_experts in its config.json)"
        )
    on_gpus = any(p.devices for p in placed_processes(cfg))  # the launcher checks those against the machine
    if replay != "disabled" and not (on_gpus or gpus_present()):
        raise ConfigError(
            f"algorithm.routing_replay={replay} needs vLLM on a GPU: vLLM-CPU cannot report the experts it routes "
            "to (its V2 model runner needs Triton); set algorithm.routing_replay=disabled"
        )
    if not experts:
        return
    if cfg.trainer.backend != "fsdp":
        raise ConfigError("a mixture-of-experts policy trains on trainer.backend=fsdp (Megatron's MoE is not wired)")
    if cfg.trainer.lora.rank > 0:
        raise ConfigError("trainer.lora with a mixture-of-experts policy is not supported yet: set trainer.lora.rank=0")
    if cfg.trainer.compile is True:
        raise ConfigError("trainer.compile=true: a mixture-of-experts policy is not compiled; set trainer.compile=auto")


LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _check_loggers(cfg: RunConfig) -> None:
    """An enabled metrics sink whose package is not installed, refused with the install command."""
    for key, package in LOGGER_PACKAGES.items():
        if getattr(cfg.metrics, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"metrics.{key}=true needs the {package} package, not installed: pip install {package}")
    if cfg.metrics.wandb and (problem := wandb_login_problem()) is not None:
        raise ConfigError(problem)  # found here, not by the controller after vLLM started


def _check_env(cfg: RunConfig) -> None:
    """Multi-turn rollouts: the factory and tools load, the budget fits the engine."""
    r = cfg.rollout
    try:
        for spec in r.tools:
            load_function(spec, what="rollout.tools entry")
        if r.env:
            load_env_factory(r.env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not r.env:
        return
    budget = r.max_total_tokens or r.max_turns * r.max_tokens
    if budget >= r.engine.max_model_len:
        raise ConfigError(
            f"rollout.max_total_tokens ({budget}{'' if r.max_total_tokens else ' = max_turns * max_tokens'}) must be "
            f"below rollout.engine.max_model_len ({r.engine.max_model_len})"
        )
    if r.tools and r.env_timeout_s <= r.tool_timeout_s:
        raise ConfigError(
            f"rollout.env_timeout_s ({r.env_timeout_s:g}) must exceed rollout.tool_timeout_s ({r.tool_timeout_s:g}): "
            "a step that waits for a tool would time out first"
        )
    if cfg.reward.overlong.enabled:
        raise ConfigError("rollout.env: reward.overlong is not supported for multi-turn samples yet")


def _check_reward_model(cfg: RunConfig, placed: int) -> None:
    """The reward_model role: exactly one of a classifier and a judge, each loadable."""
    m, j = cfg.reward.model, cfg.reward.judge
    if placed and not (m.path or j.model):
        raise ConfigError("placement has a reward_model but neither reward.model.path nor reward.judge.model is set")
    if m.path and j.model:
        raise ConfigError("reward.model.path and reward.judge.model are both set: a reward_model role serves one")
    if m.path and m.path != "tiny" and not os.path.isdir(m.path):
        raise ConfigError(f"reward.model.path '{m.path}' is not a directory (an HF sequence-classification model)")
    if not j.model:
        return
    if not os.path.isdir(j.model):
        raise ConfigError(f"reward.judge.model '{j.model}' is not a directory (an HF causal LM)")
    try:
        j.template.format(prompt="", response="", answer="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"reward.judge.template: {type(exc).__name__} {exc} (placeholders are {{prompt}}, {{response}}, "
            "{answer}; write literal braces as {{ and }})"
        ) from None
    try:
        load_function(j.parser, what="reward.judge.parser")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if j.max_tokens >= j.engine.max_model_len:
        raise ConfigError(
            f"reward.judge.max_tokens ({j.max_tokens}) must be below reward.judge.engine.max_model_len "
            f"({j.engine.max_model_len})"
        )


def _check_offload(cfg: RunConfig) -> None:
    """`trainer.offload` acts only where it can: the FSDP2 actor, without FSDP2's own full
    offload, and parameters only where vLLM uses their memory between steps."""
    off = cfg.trainer.offload
    if off.optimizer and cfg.trainer.optim.implementation == "fused":
        raise ConfigError(
            "trainer.optim.implementation=fused cannot step an offloaded optimizer (trainer.offload.optimizer "
            "streams its moments through its own AdamW step): set one of them back"
        )
    if not (off.optimizer or off.params):
        return
    if cfg.trainer.backend != "fsdp":
        raise ConfigError("trainer.offload is the FSDP2 actor's: set it off with trainer.backend=megatron")
    if cfg.fsdp.cpu_offload:
        raise ConfigError(
            "trainer.offload with fsdp.cpu_offload=true: FSDP2 already keeps parameters, gradients and optimizer "
            "state in host memory; set one of them off"
        )
    sleeping = [p for p in placed_processes(cfg) if p.role == "rollout" and rollout_sleeps(cfg, p.rank)]
    if off.params and (not sleeping or cfg.trainer.device == "cpu"):
        raise ConfigError(
            "trainer.offload.params=true frees the trainer's GPU only while a sleeping vLLM generates beside it: "
            "a synchronous colocated run (rollout.max_staleness=0, a rollout on the trainer's GPU in placement, "
            "rollout.engine.sleep_when_idle=true, trainer.device cuda); set it false here"
        )


def _check_lora(cfg: RunConfig) -> None:
    lora, engine = cfg.trainer.lora, cfg.rollout.engine
    if engine.max_lora_rank and engine.max_lora_rank not in VLLM_LORA_RANKS:
        raise ConfigError(f"rollout.engine.max_lora_rank={engine.max_lora_rank} is not one of vLLM's {VLLM_LORA_RANKS}")
    if not lora.rank:
        return
    if cfg.trainer.backend == "megatron":
        raise ConfigError("trainer.lora needs trainer.backend=fsdp: the Megatron engine has no LoRA yet")
    if lora.rank > engine_lora_rank(cfg):
        raise ConfigError(
            f"trainer.lora.rank={lora.rank} exceeds rollout.engine.max_lora_rank={engine_lora_rank(cfg)} "
            "(vLLM fixes it at start): raise max_lora_rank or lower the rank"
        )
    if not lora.target_modules:
        raise ConfigError("trainer.lora.target_modules is empty: name the modules that get adapters")
    sleeps = any(p.role == "rollout" and rollout_sleeps(cfg, p.rank) for p in placed_processes(cfg))
    if sleeps and cfg.trainer.device == "cuda":
        raise ConfigError(
            "rollout.engine.sleep_when_idle=true with trainer.lora: vLLM's wake-up after an adapter update "
            "failed on the GPU (CUDA 'invalid argument' remapping its memory, or out of memory; docs/memory.md); "
            "set sleep_when_idle false or auto"
        )


def _check_megatron(cfg: RunConfig, world: int) -> None:
    if cfg.trainer.backend != "megatron":
        return
    f = cfg.fsdp
    if f.use_fsdp and f.sharding_strategy != "NO_SHARD":
        raise ConfigError(
            "trainer.backend=megatron owns the parallelism: set fsdp.use_fsdp=false or "
            f"fsdp.sharding_strategy=NO_SHARD (got {f.sharding_strategy})"
        )
    if f.cpu_offload:
        raise ConfigError("fsdp.cpu_offload does not apply to trainer.backend=megatron")
    m = cfg.trainer.megatron
    tp_pp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    if world % tp_pp:
        raise ConfigError(
            f"trainer world size {world} is not a multiple of trainer.megatron.tensor_model_parallel_size "
            f"x pipeline_model_parallel_size = {tp_pp}"
        )
    if cfg.trainer.device == "cpu":
        raise ConfigError("trainer.backend=megatron needs trainer.device=cuda (megatron-core does not run on CPU)")
    if cfg.algorithm.kl.enabled and cfg.algorithm.kl.use == "loss":
        raise ConfigError(
            "algorithm.kl.use=loss needs a reference policy, which trainer.backend=megatron does not hold; "
            "use algorithm.kl.use=reward (critic) or trainer.backend=fsdp"
        )
    if cfg.trainer.loss.entropy_coef > 0:
        raise ConfigError(
            "trainer.loss.entropy_coef > 0 is not supported by trainer.backend=megatron (entropy is logged)"
        )
    if m.model_provider and ":" not in m.model_provider:
        raise ConfigError(f"trainer.megatron.model_provider '{m.model_provider}' must be module:function")
    if not megatron_core_installed():
        raise ConfigError("trainer.backend=megatron needs megatron-core: pip install 'tandem-rl[megatron]'")


def _check_megatron_critic(cfg: RunConfig, world: int) -> None:
    if cfg.critic.backend != "megatron":
        return
    c = cfg.critic.megatron
    if c.pipeline_model_parallel_size != 1:
        raise ConfigError(
            "critic.megatron.pipeline_model_parallel_size must be 1 (the Megatron critic has no pipeline)"
        )
    if world and world % c.tensor_model_parallel_size:
        raise ConfigError(
            f"critic world size {world} is not a multiple of critic.megatron.tensor_model_parallel_size "
            f"= {c.tensor_model_parallel_size}"
        )
    if c.model_provider:
        raise ConfigError("critic.megatron.model_provider is not supported (the critic is built from model.path)")
    if cfg.trainer.device == "cpu":
        raise ConfigError("critic.backend=megatron needs trainer.device=cuda (megatron-core does not run on CPU)")
    if not megatron_core_installed():
        raise ConfigError("critic.backend=megatron needs megatron-core: pip install 'tandem-rl[megatron]'")


def megatron_core_installed() -> bool:
    """Whether megatron-core can be imported here (the trainer's node is assumed to match)."""
    return importlib.util.find_spec("megatron.core") is not None
