"""Generation: `rollout.*`, its vLLM engine, length distribution and OpenAI endpoint."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.base import STRUCT, Doc


class EngineConfig(msgspec.Struct, **STRUCT):
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


class LengthDistConfig(msgspec.Struct, **STRUCT):
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


class OpenAIEndpointConfig(msgspec.Struct, **STRUCT):
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
    max_request_bytes: Annotated[
        int,
        Doc(
            description="Largest request body in bytes: a longer one is refused (413) before it is read. A body "
            "longer than rollout.engine.max_model_len x 32 bytes is refused (400) before it is parsed, whatever "
            "this says: it could not fit the context.",
            ge=1024,
        ),
    ] = 1048576
    header_timeout_s: Annotated[
        float,
        Doc(
            description="A connection that has not sent a request's headers in this time (or idles this long "
            "between requests) is closed.",
            gt=0,
        ),
    ] = 10.0
    body_timeout_s: Annotated[
        float, Doc(description="A request whose body has not arrived in this time gets 408.", gt=0)
    ] = 30.0


class RolloutConfig(msgspec.Struct, **STRUCT):
    max_staleness: Annotated[
        int, Doc(description="Most policy versions a trained sample may lag the trainer; 0 = synchronous PPO.", ge=0)
    ] = 1
    n: Annotated[int, Doc(description="Completions per prompt (the GRPO group size).", ge=1)] = 8
    temperature: Annotated[float, Doc(description="Sampling temperature.", ge=0.0)] = 1.0
    top_p: Annotated[float, Doc(description="Nucleus sampling mass.", gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Doc(description="Top-k sampling; 0 = off.", ge=0)] = 0
    max_tokens: Annotated[int, Doc(description="Longest response in tokens.", ge=1)] = 16
    ignore_eos: Annotated[bool, Doc(description="Generate exactly max_tokens (benchmarks).")] = False
    seeded_sampling: Annotated[
        bool,
        Doc(
            description="Each sample is drawn with a seed of its own (from the run's seed, its group id and its "
            "index; each later turn of an episode with one of its own), so a seeded run samples the same tokens "
            "whatever batches vLLM forms: a synchronous run on CPU repeats bit for bit (docs/running.md). vLLM "
            "then samples seeded requests one at a time (0.86 of unseeded throughput on CPU, BENCHMARKS.md), so "
            "off by default."
        ),
    ] = False
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
    max_error_fraction: Annotated[
        float,
        Doc(
            description="More than this fraction of the last 2 x trainer.prompts_per_step prompt groups failing "
            "their sampling (an environment, an agent or the generation failed a sample: `dropped_error`) ends "
            "the run, naming the first error; fewer cost only their groups.",
            ge=0,
            le=1,
        ),
    ] = 0.5
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
    max_observation_bytes: Annotated[
        int,
        Doc(
            description="With `env`: longest observation text in bytes; a longer one is refused before it is "
            "tokenized and ends its sample as an error (ids: those past the token budget are never read).",
            ge=1,
        ),
    ] = 1048576
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
