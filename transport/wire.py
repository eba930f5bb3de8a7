"""The wire schema: every message that crosses a process boundary.

Each message is a `msgspec.Struct` in the single tagged union `Message`; the tag is the
message's `MsgType` code. A message travels as frames:

    [header][payload][tensor frame 0][tensor frame 1]...

`header` (see `Header`) holds the schema version, the type code and a correlation id,
so a receiver can refuse a message without decoding it. `payload` is msgpack. Tensors
above a small size are not in the payload: each is its own frame.

Compatibility rule: a change that is not backwards compatible bumps `SCHEMA_VERSION`;
messages of another version are dropped and counted by the receiver.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any

import msgspec
import torch

SCHEMA_VERSION = 3  # 3: multi-turn (Completion.loss_mask, env_reward, num_turns; Generate.answer, metadata)

_HEADER = struct.Struct("<BBBxQ")


class MsgType(IntEnum):
    """One-byte type codes; the first header field after the schema version.

    Codes of retired messages are never reused (12 Abort, 13 RolloutStats, 90 TensorBatch):
    a peer that still sends one has it dropped as `unknown_type`, and the other messages'
    encoding is unchanged, so retiring a code needs no `SCHEMA_VERSION` bump."""

    REGISTER = 1
    REGISTERED = 2
    HEARTBEAT = 3
    DEAD = 4
    SHUTDOWN = 5
    ERROR = 6
    ACK = 7
    PEERS = 8
    GENERATE = 10
    COMPLETION = 11
    SLEEP_BEFORE_STEP = 14
    WEIGHT_BUCKET = 20
    WEIGHTS_APPLIED = 21
    SYNC_WEIGHTS = 22
    WEIGHT_GROUP_INIT = 23
    WEIGHT_BUCKET_META = 26
    WEIGHT_CHECKSUMS = 27
    REWARD_REQUEST = 30
    REWARD_RESULT = 31
    TRAIN_BATCH = 40
    TRAIN_RESULT = 41
    SAVE_CHECKPOINT = 42
    CHECKPOINT_SAVED = 43
    VALUE_REQUEST = 50
    VALUE_RESULT = 51
    TEACHER_REQUEST = 60
    TEACHER_RESULT = 61


class Flag(IntEnum):
    """Header flag bits."""

    NONE = 0
    REPLY = 1


class ErrorCode(IntEnum):
    """Compact error classes carried by `Error`."""

    INTERNAL = 1
    BAD_REQUEST = 2
    TIMEOUT = 3
    REFUSED = 4
    UNAVAILABLE = 5


class FinishReason(IntEnum):
    """Why a completion ended."""

    LENGTH = 1
    STOP = 2
    ABORT = 3
    ERROR = 4


class Header(msgspec.Struct, frozen=True, gc=False):
    """Fixed-size first frame: schema version, type code, flags, correlation id."""

    schema: int
    type: int
    flags: int
    corr: int

    def pack(self) -> bytes:
        return _HEADER.pack(self.schema, self.type, self.flags, self.corr)

    @staticmethod
    def unpack(frame: bytes | memoryview) -> Header:
        """Parse a header frame; raises ValueError when it is not exactly one header."""
        if len(frame) != _HEADER.size:
            raise ValueError(f"header frame is {len(frame)} bytes, expected {_HEADER.size}")
        return Header(*_HEADER.unpack(frame))


def _msg(tag: MsgType) -> dict[str, Any]:
    return dict(tag=int(tag), array_like=True, omit_defaults=True, gc=False)


# --- lifecycle -------------------------------------------------------------------------


class PeerInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A registered role: who it is and where its own server (if any) listens."""

    role: str
    rank: int
    node: int = 0
    address: str = ""
    version: int = 0
    capabilities: dict[str, Any] = {}


class Register(msgspec.Struct, **_msg(MsgType.REGISTER)):
    """A role introduces itself to the controller; answered by `Registered`."""

    peer: PeerInfo
    pid: int = 0
    token: str = ""  # the run's secret (runtime/identity/run_token.py)


class Registered(msgspec.Struct, **_msg(MsgType.REGISTERED)):
    """The controller's answer to `Register`: the run id and the peers known so far."""

    run_id: str
    peers: list[PeerInfo] = []
    policy_version: int = 0


class Peers(msgspec.Struct, **_msg(MsgType.PEERS)):
    """The current set of peers of one role kind (sent when it changes)."""

    role: str
    peers: list[PeerInfo] = []


class Heartbeat(msgspec.Struct, **_msg(MsgType.HEARTBEAT)):
    sent_at: float = 0.0


class Dead(msgspec.Struct, **_msg(MsgType.DEAD)):
    """Sent by a role that is about to exit because of a fatal error."""

    role: str
    rank: int
    cause: str


class Shutdown(msgspec.Struct, **_msg(MsgType.SHUTDOWN)):
    reason: str = ""


class Error(msgspec.Struct, **_msg(MsgType.ERROR)):
    """A failed request: the reply carries the class and a one-line reason."""

    code: ErrorCode
    message: str


class Ack(msgspec.Struct, **_msg(MsgType.ACK)):
    info: str = ""


# --- rollout ---------------------------------------------------------------------------


class SleepBeforeStep(msgspec.Struct, **_msg(MsgType.SLEEP_BEFORE_STEP)):
    """Controller -> rollout, in a synchronous run before each training step: every sample
    of `version` the step needs is in, and the next weights this rollout receives are the
    trainer's next version, each tensor of it. A rollout that shares its GPU with a trainer
    rank sleeps and then replies `Ack` (info: the sleep level, or why it stays awake)."""

    version: int


class SamplingSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampling parameters of one generate request (vLLM's meaning for each field)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None


class Generate(msgspec.Struct, **_msg(MsgType.GENERATE)):
    """Generate `sampling.n` completions of one prompt; each returns as a `Completion`.
    `answer` and `metadata` are the dataset row's, for a multi-turn environment."""

    request_id: str
    group_id: int
    prompt_ids: list[int]
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    answer: Any = None
    metadata: dict[str, Any] = {}


class Completion(msgspec.Struct, **_msg(MsgType.COMPLETION)):
    """One finished sample: tokens, behaviour logprobs and the policy version per token.

    A multi-turn sample (`rollout.env`) is the whole trajectory after the prompt, as its
    tokens were sampled or inserted: `loss_mask` is 1 on tokens the policy sampled and 0
    on tokens the environment inserted (observations, tool results), whose `logprobs` are
    0 and whose `versions` repeat the nearest sampled token's, so `versions.min()` is the
    oldest sampled token's. `loss_mask` None means every token was sampled (single turn).
    `env_reward` is the sum of the rewards the environment gave (None: it gave none).
    `routed_experts` (a mixture-of-experts policy, `algorithm.routing_replay` on): the experts
    vLLM routed each of the sequence's first N tokens to, prompt first, [N, layers, top_k],
    uint8 (int16 beyond 256 experts); tokens past N (at least the last) were not reported.
    """

    request_id: str
    group_id: int
    sample_index: int
    token_ids: torch.Tensor  # int64 [T]
    logprobs: torch.Tensor  # float32 [T], logprob of each sampled token (0 where loss_mask is 0)
    versions: torch.Tensor  # int32 [T], policy version that produced each token
    finish_reason: FinishReason
    prompt_len: int = 0
    gen_s: float = 0.0
    error: str = ""
    loss_mask: torch.Tensor | None = None  # uint8 [T]; None: all 1
    env_reward: float | None = None
    num_turns: int = 0  # assistant turns generated (0: single-turn, no environment)
    routed_experts: torch.Tensor | None = None  # uint8 | int16 [N, layers, top_k], N <= prompt_len + T


# --- weights ---------------------------------------------------------------------------


class WeightBucket(msgspec.Struct, **_msg(MsgType.WEIGHT_BUCKET)):
    """Part of a policy version: named tensors (HF parameter names)."""

    version: int
    index: int
    last: bool
    tensors: dict[str, torch.Tensor]
    token: str = ""  # the run's secret: a rollout takes weights only with it


class WeightsApplied(msgspec.Struct, **_msg(MsgType.WEIGHTS_APPLIED)):
    """A rollout now generates with `version`; times of each phase in seconds."""

    version: int
    receive_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    num_tensors: int = 0
    num_bytes: int = 0
    rollout: str = ""


class SyncWeights(msgspec.Struct, **_msg(MsgType.SYNC_WEIGHTS)):
    """Controller → trainer: bring the named rollouts to the current version."""

    rollouts: list[PeerInfo]


# --- weights over a collective group (weight_sync.backend=nccl) --------------------------


class WeightGroupInit(msgspec.Struct, **_msg(MsgType.WEIGHT_GROUP_INIT)):
    """Trainer → rollout: join a dedicated broadcast group for weight updates.

    Trainer rank 0 is group rank 0 and hosts the group's TCPStore at `host:port` (keys
    under `prefix`); the rollout's vLLM workers take ranks `rank_offset + worker rank`.
    `backend` is the torch.distributed backend (`nccl` or `gloo`). Both sides join at the
    same time; the answer is `Ack` once the group is formed, or `Error`.
    """

    host: str
    port: int
    prefix: str
    world_size: int = 2
    rank_offset: int = 1
    backend: str = "gloo"
    timeout_s: float = 60.0
    token: str = ""


class TensorSlot(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where one named tensor lies: bytes `[offset, offset + nbytes)` of bucket `bucket`."""

    name: str
    dtype: str
    shape: list[int]
    bucket: int
    offset: int
    nbytes: int


class IpcHandle(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A CUDA buffer shared by CUDA IPC (see roles/weights/ipc.py): the fields of torch's
    own CUDA tensor reduction, as bytes and numbers."""

    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    tensor_offset: int
    numel: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes = b""
    event_sync: bool = False


class WeightBucketMeta(msgspec.Struct, **_msg(MsgType.WEIGHT_BUCKET_META)):
    """Trainer → rollout, one per bucket of `version` on the GPU-resident paths: the
    bucket's layout, and where its bytes are — in the shared buffer `ipc` (backend
    `ipc`), or in the broadcast that follows on the weight group (`ipc` None: backend
    `nccl`). Answered by `Ack` once loaded; the `last` one by `WeightsApplied` once the
    version is switched. Bucket 0 begins an update: refused (`REFUSED`) for a version
    older than the rollout's."""

    version: int
    index: int
    last: bool
    slots: list[TensorSlot]
    nbytes: int
    ipc: IpcHandle | None = None
    token: str = ""


class WeightChecksums(msgspec.Struct, **_msg(MsgType.WEIGHT_CHECKSUMS)):
    """Token holder → rollout (weights socket): the sum of every vLLM parameter (float64,
    by vLLM's own parameter name) at `version`, which the rollout fills in on reply. A
    cheap proof that an update wrote every tensor; empty `sums` in the request, and the
    run's secret in `token` (a trailing field with a default: no `SCHEMA_VERSION` bump;
    the reply leaves it empty)."""

    version: int = -1
    sums: dict[str, float] = {}
    token: str = ""


# --- reward ----------------------------------------------------------------------------


class RewardItem(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sample to score: `prompt` is the policy's prompt text (chat template applied),
    `messages` the same prompt as chat messages before any template (the reward model
    applies its own). `messages` is a trailing field with a default: peers without it
    decode this struct unchanged (no `SCHEMA_VERSION` bump)."""

    sample_id: int
    prompt: str
    completion: str
    prompt_ids: list[int] = []
    completion_ids: list[int] = []
    answer: Any = None
    metadata: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []


class RewardRequest(msgspec.Struct, **_msg(MsgType.REWARD_REQUEST)):
    items: list[RewardItem]


class RewardScore(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sample's score; with `error`, the reward is 0 and `reason` says why in a word
    (roles/reward/workers.py REASONS, or `model` for a reward model's failure)."""

    sample_id: int
    reward: float
    error: str = ""
    reason: str = ""  # appended last: a peer without it ignores it


class RewardResult(msgspec.Struct, **_msg(MsgType.REWARD_RESULT)):
    scores: list[RewardScore]


# --- training --------------------------------------------------------------------------


class TrainBatch(msgspec.Struct, **_msg(MsgType.TRAIN_BATCH)):
    """One trainer rank's shard of a training step, as packed sequences.

    Every per-token tensor has `cu_seqlens[-1]` entries: sequence i occupies
    `[cu_seqlens[i], cu_seqlens[i+1])`, prompt tokens first. `loss_mask` is 1 on response
    tokens. `global_num_tokens` / `global_num_seqs` count the whole step (all shards),
    so each rank can normalise its loss the same way.
    """

    step: int
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    global_num_tokens: int
    global_num_seqs: int
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    # Filled in by the trainer itself (its no-grad forward before the first of several
    # updates); the controller never sends it.
    proximal_logprobs: torch.Tensor | None = None
    # Routing replay (a mixture-of-experts policy): the experts the rollout routed each token
    # to, [total_tokens, layers, top_k] (uint8 | int16), and uint8 [total_tokens], 1 where a
    # row holds the engine's report (0: the trainer routes that token itself).
    routed_experts: torch.Tensor | None = None
    routed_mask: torch.Tensor | None = None


# The one list of a TrainBatch's per-token fields (one row per packed token, `cu_seqlens[-1]`
# rows; all but input_ids may be None), in field order: every field but these four, which
# describe the batch as a whole. Code that handles a subset names it as this list less what
# it leaves out, and says why.
TRAIN_BATCH_TOKEN_FIELDS: tuple[str, ...] = tuple(
    f for f in TrainBatch.__struct_fields__ if f not in ("step", "cu_seqlens", "global_num_tokens", "global_num_seqs")
)


class TrainResult(msgspec.Struct, **_msg(MsgType.TRAIN_RESULT)):
    """A finished step: the new policy version, the step's metrics, and the rollouts the
    new weights could not reach (elastic runs carry on without them)."""

    step: int
    version: int
    metrics: dict[str, float] = {}
    failed_rollouts: list[str] = []


class SaveCheckpoint(msgspec.Struct, **_msg(MsgType.SAVE_CHECKPOINT)):
    step: int
    directory: str


class CheckpointSaved(msgspec.Struct, **_msg(MsgType.CHECKPOINT_SAVED)):
    step: int
    directory: str


class ValueRequest(msgspec.Struct, **_msg(MsgType.VALUE_REQUEST)):
    """Values for packed sequences (layout as in `TrainBatch`)."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor


class ValueResult(msgspec.Struct, **_msg(MsgType.VALUE_RESULT)):
    """Per-token values (see roles/critic/fsdp_engine.py for the alignment) and, when the critic
    holds the reference policy, its token logprobs in the same layout."""

    values: torch.Tensor  # float32 [total_tokens]
    version: int = 0
    ref_logprobs: torch.Tensor | None = None


# --- distillation ----------------------------------------------------------------------


class TeacherItem(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One finished sample for the teacher: the prompt's token ids and the response's (every
    token, environment tokens of a multi-turn sample included: the teacher reads them as context)."""

    sample_id: int
    prompt_ids: list[int]
    completion_ids: list[int]


class TeacherRequest(msgspec.Struct, **_msg(MsgType.TEACHER_REQUEST)):
    items: list[TeacherItem]


class TeacherScore(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The teacher's log-probability of each response token of one sample (`len(completion_ids)`
    of them); with `error`, none (`logprobs` empty) and `reason` says why in a word."""

    sample_id: int
    logprobs: list[float] = []
    error: str = ""
    reason: str = ""


class TeacherResult(msgspec.Struct, **_msg(MsgType.TEACHER_RESULT)):
    scores: list[TeacherScore]


Message = (
    Register
    | Registered
    | Peers
    | Heartbeat
    | Dead
    | Shutdown
    | Error
    | Ack
    | Generate
    | Completion
    | SleepBeforeStep
    | WeightBucket
    | WeightsApplied
    | SyncWeights
    | RewardRequest
    | RewardResult
    | TrainBatch
    | TrainResult
    | SaveCheckpoint
    | CheckpointSaved
    | ValueRequest
    | ValueResult
    | WeightGroupInit
    | WeightBucketMeta
    | WeightChecksums
    | TeacherRequest
    | TeacherResult
)

MESSAGE_TYPES: dict[int, type] = {
    cls.__struct_config__.tag: cls  # type: ignore[attr-defined]
    for cls in Message.__args__  # type: ignore[attr-defined]
}


def type_code(msg: Any) -> int:
    """The `MsgType` code of a message instance."""
    return type(msg).__struct_config__.tag  # type: ignore[no-any-return]
