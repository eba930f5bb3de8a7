"""The actor trainer: `trainer.*` and `fsdp.*`, with optimizer, loss, KL, Megatron, LoRA and offload."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.base import STRUCT, Doc


class MixedPrecisionConfig(msgspec.Struct, **STRUCT):
    param_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"],
        Doc(description="Dtype of the all-gathered params used in forward/backward."),
    ] = "bfloat16"
    reduce_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], Doc(description="Dtype of gradient reduce-scatter / all-reduce.")
    ] = "float32"


ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
BackwardPrefetch = Literal["BACKWARD_PRE", "BACKWARD_POST", "none"]


class FSDPConfig(msgspec.Struct, **STRUCT):
    """verl-style FSDP settings, mapped onto FSDP2 (`fully_shard`); see docs/fsdp.md."""

    use_fsdp: Annotated[
        bool, Doc(description="Shard with FSDP2; false = plain data parallel (gradients all-reduced).")
    ] = True
    sharding_strategy: Annotated[
        ShardingStrategy, Doc(description="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD.")
    ] = "FULL_SHARD"
    cpu_offload: Annotated[
        bool,
        Doc(
            description="FSDP2's full offload (CPUOffloadPolicy, pageable host memory): master weights, gradients "
            "and optimizer state on the host, the optimizer step on the CPU, every micro-batch's gradients reduced "
            "to the host (needs an accelerator). `auto` (the default) = only where the memory plan fits nothing "
            "else (false where no GPU size is known)."
        ),
    ] = False
    mixed_precision: Annotated[
        MixedPrecisionConfig | None, Doc(description="Mixed precision policy; null = train in the params' dtype.")
    ] = None
    backward_prefetch: Annotated[BackwardPrefetch, Doc(description="BACKWARD_PRE, BACKWARD_POST or none.")] = (
        "BACKWARD_PRE"
    )
    ignored_modules: Annotated[
        list[str], Doc(description="Module names (fnmatch patterns) whose params stay unsharded.")
    ] = []
    hybrid_shard_size: Annotated[
        int, Doc(description="HYBRID_SHARD: ranks per shard group; 0 = ranks per node.", ge=0)
    ] = 0
    param_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], Doc(description="Dtype the trainer keeps master params in.")
    ] = "float32"
    one_rank_accumulation: Annotated[
        Literal["unsharded", "reduced"],
        Doc(
            description="One rank, several micro-batches: `unsharded` = FSDP2 adds each micro-batch's gradient into "
            "an unsharded copy in the reduce dtype and reduces once per step; `reduced` = each micro-batch's "
            "gradient is cast into FSDP2's flat reduce buffer and added to the sharded gradient on its reduce stream. "
            "The same sums; parameters stay gathered either way (docs/fsdp.md). With cpu_offload always `reduced`."
        ),
    ] = "unsharded"


class OptimConfig(msgspec.Struct, **STRUCT):
    lr: Annotated[float, Doc(description="AdamW learning rate.", gt=0)] = 1e-5
    betas: Annotated[list[float], Doc(description="AdamW betas.")] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    weight_decay: Annotated[float, Doc(description="AdamW weight decay.", ge=0)] = 0.0
    eps: Annotated[float, Doc(description="AdamW epsilon.", gt=0)] = 1e-8
    warmup_steps: Annotated[int, Doc(description="Linear learning-rate warm-up steps.", ge=0)] = 0
    grad_clip: Annotated[float, Doc(description="Clip the global gradient norm to this; 0 = off.", ge=0)] = 1.0
    implementation: Annotated[
        Literal["auto", "fused"],
        Doc(
            description="FSDP engines: AdamW's step; auto = torch's default (foreach on CUDA), fused = torch's "
            "fused AdamW kernels (not with trainer.offload.optimizer)."
        ),
    ] = "auto"


class RolloutCorrectionConfig(msgspec.Struct, **STRUCT):
    """The importance weight exp(proximal - behaviour logprob) that corrects for the
    vLLM-trainer mismatch and for staleness (decoupled PPO)."""

    mode: Annotated[
        Literal["truncate", "mask"],
        Doc(
            description="`truncate`: cap the weight at trainer.loss.importance_cap (truncated IS); `mask`: weights "
            "outside [mask_low, mask_high] become 0 (masked IS), the others are used as they are."
        ),
    ] = "truncate"
    level: Annotated[
        Literal["token", "sequence"],
        Doc(description="`token`: a weight per token; `sequence`: the product of a sequence's token ratios."),
    ] = "token"
    mask_low: Annotated[float, Doc(description="mode=mask: weights below this are masked.", ge=0)] = 0.5
    mask_high: Annotated[float, Doc(description="mode=mask: weights above this are masked.", gt=0)] = 2.0


class LossConfig(msgspec.Struct, **STRUCT):
    clip_low: Annotated[float, Doc(description="PPO ratio clip below 1 (ratio >= 1 - clip_low).", ge=0)] = 0.2
    clip_high: Annotated[float, Doc(description="PPO ratio clip above 1 (ratio <= 1 + clip_high).", ge=0)] = 0.2
    importance_cap: Annotated[
        float,
        Doc(
            description="Cap of the behaviour importance weight prox/behaviour (rollout_correction.mode=truncate).",
            gt=0,
        ),
    ] = 5.0
    entropy_coef: Annotated[float, Doc(description="Entropy bonus coefficient.", ge=0)] = 0.0
    router_aux_coef: Annotated[
        float,
        Doc(
            description="Mixture-of-experts policies: coefficient of the routers' load-balancing loss "
            "(router_aux_loss, reported either way; 0 leaves it out of the loss).",
            ge=0,
        ),
    ] = 0.0
    mode: Annotated[
        Literal["vanilla", "dual-clip", "gspo", "cispo"],
        Doc(
            description="`vanilla`: clipped surrogate; `dual-clip`: plus the bound clip_ratio_c for negative "
            "advantages; `gspo`: sequence-level geometric-mean ratio (use agg seq-mean-token-mean); `cispo`: "
            "clipped, stop-gradient ratio times logprob (clip_low/clip_high clip the weight)."
        ),
    ] = "vanilla"
    clip_ratio_c: Annotated[
        float, Doc(description="dual-clip: for A < 0 the loss is at most -clip_ratio_c * A.", gt=1.0)
    ] = 3.0
    agg: Annotated[
        Literal[
            "token-mean",
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
            "token-sum",
            "seq-mean",
        ],
        Doc(
            description="Loss aggregation: token-mean (DAPO), seq-mean-token-mean (GRPO; `seq-mean` is its old "
            "alias), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: sum / (seqs * norm_tokens)), token-sum."
        ),
    ] = "token-mean"
    norm_tokens: Annotated[
        int, Doc(description="seq-mean-token-sum-norm: the constant length normaliser; 0 = rollout.max_tokens.", ge=0)
    ] = 0
    rollout_correction: Annotated[
        RolloutCorrectionConfig, Doc(description="Behaviour-policy importance weights (truncated or masked IS).")
    ] = msgspec.field(default_factory=RolloutCorrectionConfig)


class KLConfig(msgspec.Struct, **STRUCT):
    """KL to a frozen reference policy (the initial weights), held by the trainer."""

    enabled: Annotated[bool, Doc(description="Keep a frozen reference model and compute KL to it.")] = False
    estimator: Annotated[
        Literal["k1", "k2", "k3", "low_var_kl"],
        Doc(description="Per-token KL estimator; k3 (alias low_var_kl, verl's name) is clamped to at most 10."),
    ] = "k3"
    use: Annotated[
        Literal["loss", "reward"],
        Doc(description="`loss`: add coef*KL to the loss; `reward`: subtract it from token rewards."),
    ] = "loss"
    coef: Annotated[float, Doc(description="Initial KL coefficient.", ge=0)] = 0.001
    adaptive: Annotated[bool, Doc(description="Adapt the coefficient towards `target` (PPO adaptive KL).")] = False
    target: Annotated[float, Doc(description="Adaptive KL target.", gt=0)] = 0.01
    horizon: Annotated[int, Doc(description="Adaptive KL horizon in samples.", gt=0)] = 10000


class MegatronConfig(msgspec.Struct, **STRUCT):
    tensor_model_parallel_size: Annotated[int, Doc(description="Megatron TP size.", ge=1)] = 1
    pipeline_model_parallel_size: Annotated[int, Doc(description="Megatron PP size.", ge=1)] = 1
    use_distributed_optimizer: Annotated[bool, Doc(description="Shard optimizer state across data-parallel ranks.")] = (
        False
    )
    params_dtype: Annotated[
        Literal["bfloat16", "float32"],
        Doc(description="Model params; bfloat16 keeps fp32 master weights in the optimizer."),
    ] = "bfloat16"
    model_provider: Annotated[
        str,
        Doc(
            description="`module:function(hf_config, transformer_config)` returning this rank's GPTModel stage "
            "or a MegatronActor; empty = built from model.path's config."
        ),
    ] = ""


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(msgspec.Struct, **STRUCT):
    """LoRA adapters on the actor (PEFT): only they train, and only they travel to the rollouts."""

    rank: Annotated[int, Doc(description="Adapter rank r; 0 = full fine-tuning (no adapters).", ge=0)] = 0
    alpha: Annotated[int, Doc(description="lora_alpha: the update is scaled by alpha / rank.", gt=0)] = 16
    dropout: Annotated[float, Doc(description="Dropout on the adapters' input (training only).", ge=0.0, lt=1.0)] = 0.0
    target_modules: Annotated[
        list[str], Doc(description="Module names that get adapters (default: attention and MLP projections).")
    ] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))


class OffloadConfig(msgspec.Struct, **STRUCT):
    """What the FSDP2 actor keeps in host memory instead of on its GPU (docs/memory.md)."""

    optimizer: Annotated[
        bool,
        Doc(
            description="AdamW's two moment tensors live in pinned host memory; each optimizer step streams them "
            "through the GPU in chunks (copies overlapped with the update). Saves 8 bytes per trained parameter. "
            "`auto` (the default) = only where the memory plan fits nothing without it (false where no GPU size "
            "is known)."
        ),
    ] = False
    params: Annotated[
        bool,
        Doc(
            description="Synchronous colocated runs: the master parameters move to host memory after each weight "
            "update and back before the next step, so vLLM's KV cache has their GPU memory while it generates. "
            "`auto` (the default) = only where the memory plan fits nothing without it (false where no GPU size "
            "is known)."
        ),
    ] = False
    chunk_mb: Annotated[
        int,
        Doc(description="offload.optimizer: MiB of optimizer state per streamed chunk (two chunks on the GPU).", ge=1),
    ] = 512


class TrainerConfig(msgspec.Struct, **STRUCT):
    backend: Annotated[
        Literal["fsdp", "megatron"],
        Doc(description="Training engine: FSDP2 or Megatron-core (needs the megatron extra and CUDA)."),
    ] = "fsdp"
    total_steps: Annotated[int, Doc(description="Training steps (policy versions) of the run.", ge=1)] = 20
    prompts_per_step: Annotated[
        int, Doc(description="Prompt groups per training step; batch size = prompts_per_step * rollout.n.", ge=1)
    ] = 8
    micro_batch_tokens: Annotated[
        int,
        Doc(
            description="Token budget of one micro-batch (padded tokens; real tokens when packing). `auto` (the "
            "default) = the largest power of two the memory plan fits, up to 16384 and to a rank's share of a step "
            "(4096 where no GPU size is known).",
            ge=1,
        ),
    ] = 4096
    ppo_epochs: Annotated[
        int,
        Doc(
            description="Passes over each batch. With ppo_epochs or mini_batches above 1 the proximal logprobs come "
            "from one no-grad forward before the first update and the PPO clip acts; 1 and 1 = one update per batch.",
            ge=1,
        ),
    ] = 1
    mini_batches: Annotated[
        int,
        Doc(
            description="Optimizer steps per epoch: each rank's shard is split into this many seeded, shuffled "
            "mini-batches (ppo_epochs x mini_batches steps per batch; the policy version still counts batches).",
            ge=1,
        ),
    ] = 1
    optim: Annotated[OptimConfig, Doc(description="Optimizer.")] = msgspec.field(default_factory=OptimConfig)
    loss: Annotated[LossConfig, Doc(description="Policy loss.")] = msgspec.field(default_factory=LossConfig)
    megatron: Annotated[MegatronConfig, Doc(description="Megatron-core options (backend: megatron).")] = msgspec.field(
        default_factory=MegatronConfig
    )
    lora: Annotated[LoraConfig, Doc(description="LoRA adapters (FSDP actor; rank 0 = off).")] = msgspec.field(
        default_factory=LoraConfig
    )
    gradient_checkpointing: Annotated[bool, Doc(description="Recompute activations in backward.")] = False
    offload: Annotated[OffloadConfig, Doc(description="Host-memory offload of optimizer state and parameters.")] = (
        msgspec.field(default_factory=OffloadConfig)
    )
    packing: Annotated[
        bool,
        Doc(
            description="FSDP actor: pack each micro-batch's sequences into one row with variable-length attention "
            "(no padding; micro_batch_tokens counts real tokens, length-balanced bins); false = padded rows."
        ),
    ] = True
    logprob_chunk_tokens: Annotated[
        int,
        Doc(
            description="FSDP actor: logprobs and entropy from the last hidden state and the LM head this many "
            "positions at a time, never the micro-batch's full [T, vocab] logits; 0 = full logits.",
            ge=0,
        ),
    ] = 1024
    compile: Annotated[
        bool | Literal["auto"],
        Doc(
            description="FSDP actor: torch.compile each transformer block (dynamic shapes), fusing norms, RoPE and "
            "activations, and the chunked LM head's per-chunk math; the first steps compile. auto = on for a "
            "full-parameter actor on CUDA with trainer.kernels=torch (16 % faster steps, 14 GB less at 1.54B), "
            "off on the CPU, with LoRA adapters and with liger kernels."
        ),
    ] = "auto"
    kernels: Annotated[
        Literal["torch", "liger"],
        Doc(
            description="FSDP actor: kernels for RMSNorm, the SwiGLU MLP and RoPE; torch = transformers' own "
            "(fused by trainer.compile), liger = Liger Kernel's Triton kernels (needs liger-kernel and CUDA, "
            "and trainer.compile=false: dynamo cannot trace them)."
        ),
    ] = "torch"
    attention_kernel: Annotated[
        Literal["torch", "fa4", "cudnn"],
        Doc(
            description="FSDP actor with packing, on CUDA: the varlen attention kernels; torch = PyTorch's "
            "FlashAttention-2 varlen (varlen_attn), fa4 = flash-attn-4's CuTe kernels, forward and backward "
            "(FA3-class on Hopper; needs the flash-attn-4 package; compiles its kernels on first use), cudnn = "
            "cuDNN's fused attention on ragged tensors through PyTorch's own entry points (needs cuDNN 9)."
        ),
    ] = "torch"
    device: Annotated[
        Literal["auto", "cpu", "cuda"], Doc(description="Where the trainer computes; auto = cuda when available.")
    ] = "auto"
    seed: Annotated[int, Doc(description="Trainer seed.")] = 0
    collective_timeout_s: Annotated[
        float,
        Doc(description="Bound on the trainer's (and critic's) rendezvous and each collective of its world.", gt=0),
    ] = 600.0
    max_nonfinite_steps: Annotated[
        int,
        Doc(
            description="End the run after this many steps in a row whose loss or gradient norm is NaN or infinite "
            "(each one's optimizer step is skipped: gradients dropped, weights unchanged, counted as "
            "`update_skipped`); the error names the step, the micro-batch and the last checkpoint.",
            ge=1,
        ),
    ] = 3
