"""The run's remaining sections (weight sync, checkpoints, placement, transport, metrics,
validation, memory) and `RunConfig`, the whole tree."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.algorithm import AlgorithmConfig
from runtime.config.base import STRUCT, Doc
from runtime.config.critic import CriticConfig
from runtime.config.data import DataConfig
from runtime.config.model import ModelConfig
from runtime.config.reward import RewardConfig
from runtime.config.rollout import RolloutConfig
from runtime.config.trainer import FSDPConfig, TrainerConfig


class WeightSyncConfig(msgspec.Struct, **STRUCT):
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


class CheckpointConfig(msgspec.Struct, **STRUCT):
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


class PlacementEntry(msgspec.Struct, **STRUCT):
    role: Annotated[
        Literal["controller", "rollout", "trainer", "reward", "critic", "reward_model", "teacher"],
        Doc(description="Role kind."),
    ]
    count: Annotated[int, Doc(description="Processes of this role (trainer: ranks).", ge=0)] = 1
    devices: Annotated[list[int], Doc(description="GPU indices; one per process, or shared when fewer.")] = []
    env: Annotated[dict[str, str], Doc(description="Extra environment variables.")] = {}
    node: Annotated[int, Doc(description="Node rank that runs these processes.", ge=0)] = 0
    nodes: Annotated[
        list[int], Doc(description="Instead of `node`: run `count` processes on each of these node ranks.")
    ] = []


class TransportConfig(msgspec.Struct, **STRUCT):
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


class MetricsConfig(msgspec.Struct, **STRUCT):
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


class ValidationConfig(msgspec.Struct, **STRUCT):
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


class MemoryConfig(msgspec.Struct, **STRUCT):
    """The launch-time memory plan (runtime/memory/plan.py, `tandem launch --plan`)."""

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
            "(nvidia-smi) when `tandem launch` settles the `auto` keys.",
            ge=0,
        ),
    ] = 0.0
    host_gb: Annotated[
        float, Doc(description="Host memory in GB the plan assumes; 0 = read it at launch (/proc/meminfo).", ge=0)
    ] = 0.0
    chosen: Annotated[
        list[str],
        Doc(
            description="Written when `tandem launch` settles the `auto` keys: what each became on this machine "
            "and why (RUN_DIR/config.yaml keeps it; `tandem launch --plan` and the run's first lines print it). "
            "Replaced whenever a key is `auto`."
        ),
    ] = []


class RunConfig(msgspec.Struct, **STRUCT):
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
