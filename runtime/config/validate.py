"""The checks across a config's sections, read from the config alone: `check_config` asks
nothing of the machine, its packages or its files (runtime/preflight/environment.py does, at
launch), so a config is checked the same on any machine.

Each failed check is a `ConfigError` with one line naming the keys involved.
"""

from __future__ import annotations

import msgspec

from runtime.config import RunConfig
from runtime.config.gpu_share import check_gpu_memory, check_ipc_weight_sync, check_nccl_weight_sync
from runtime.config.lora_settings import VLLM_LORA_RANKS, engine_lora_rank
from runtime.config.placement import placed_processes, role_counts, rollout_sleeps
from runtime.errors import ConfigError


def _check_fsdp_gpu_option(cfg: RunConfig, setting: str, gpu_only: str) -> None:
    """`setting` (e.g. "trainer.kernels=liger") is a GPU kernel of the FSDP actor: refuse it
    on Megatron and on a CPU trainer, `gpu_only` saying why."""
    if cfg.trainer.backend != "fsdp":
        raise ConfigError(f"{setting} applies to the FSDP actor only; trainer.backend is megatron")
    if cfg.trainer.device == "cpu":
        raise ConfigError(f"{setting} needs trainer.device=cuda ({gpu_only})")


def _check_kernels(cfg: RunConfig) -> None:
    """`trainer.kernels=liger`: Triton kernels for the FSDP actor, so CUDA, and no
    `trainer.compile` (which cannot trace them); the package is asked for at launch."""
    if cfg.trainer.kernels != "liger":
        return
    _check_fsdp_gpu_option(cfg, "trainer.kernels=liger", "Liger Kernel's kernels run on GPUs only")
    if cfg.trainer.compile is True:  # an AssertionError inside dynamo
        raise ConfigError(
            "trainer.kernels=liger cannot run with trainer.compile=true (dynamo fails on Liger's RMSNorm "
            "autograd.Function, torch 2.11; Liger-Kernel issue #174): set one of them back"
        )


def _check_attention_kernel(cfg: RunConfig) -> None:
    """`trainer.attention_kernel=fa4|cudnn`: flash-attn-4's or cuDNN's CUDA kernels in the packed FSDP actor
    (whether they are installed is asked at launch: runtime/preflight/environment.py)."""
    kernel = cfg.trainer.attention_kernel
    if kernel == "torch":
        return
    option = f"trainer.attention_kernel={kernel}"
    _check_fsdp_gpu_option(cfg, option, "its kernels run on GPUs only")
    if not cfg.trainer.packing:
        raise ConfigError(f"{option} needs trainer.packing=true (it is the packed varlen kernel)")


def check_config(cfg: RunConfig) -> None:
    counts = role_counts(cfg)
    check_inert_options(cfg)
    _check_lora(cfg)
    _check_offload(cfg)
    _check_kernels(cfg)
    _check_attention_kernel(cfg)
    _check_megatron(cfg, counts.get("trainer", 0))
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
    _check_env(cfg)
    _check_reward_model(cfg, counts.get("reward_model", 0))
    check_distill(cfg, counts.get("teacher", 0))
    # Only the memory budget here: device indices need the real GPU count (runtime/preflight/gpus.py).
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


def _check_env(cfg: RunConfig) -> None:
    """Multi-turn rollouts: the budget fits the engine, the timeouts nest."""
    r = cfg.rollout
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
    """The reward_model role: exactly one of a classifier and a judge; the judge's template
    and budget fit."""
    m, j = cfg.reward.model, cfg.reward.judge
    if placed and not (m.path or j.model):
        raise ConfigError("placement has a reward_model but neither reward.model.path nor reward.judge.model is set")
    if m.path and j.model:
        raise ConfigError("reward.model.path and reward.judge.model are both set: a reward_model role serves one")
    if not j.model:
        return
    try:
        j.template.format(prompt="", response="", answer="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"reward.judge.template: {type(exc).__name__} {exc} (placeholders are {{prompt}}, {{response}}, "
            "{answer}; write literal braces as {{ and }})"
        ) from None
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


def check_distill(cfg: RunConfig, placed: int) -> None:
    """`algorithm.distill` against the placement and the rollout (ConfigError, one line):
    a placed teacher needs a teacher model; the teacher's engine must take every sample the
    rollout's can produce."""
    d = cfg.algorithm.distill
    if placed and not d.enabled:
        raise ConfigError("placement has a teacher but algorithm.distill.teacher is not set")
    if not d.enabled:
        return
    if d.reward == "replace" and cfg.algorithm.filter_groups:
        raise ConfigError(
            "algorithm.filter_groups drops groups of equal task reward, which algorithm.distill.reward=replace does "
            "not train on: turn one of them off (or use algorithm.distill.reward=add)"
        )
    need = cfg.rollout.engine.max_model_len
    if d.engine.max_model_len < need:
        raise ConfigError(
            f"algorithm.distill.engine.max_model_len ({d.engine.max_model_len}) is below rollout.engine.max_model_len "
            f"({need}): the teacher must read every prompt and response the rollout produces"
        )
