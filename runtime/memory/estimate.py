"""What one role process holds in GPU and host memory, estimated from the config alone.

Pure arithmetic (no torch, no vLLM): `ModelShape` reads the policy's shape from
`model.path`'s config.json or from `model.tiny`; `trainer_memory` and `rollout_memory`
return a role's consumers as `Item`s, each in the phase it is held:

* `always`: held from start to end (master weights, resident optimizer state);
* `step`:   held only while the trainer steps (gradients, activations, the compute copy);
* `update`: held only while weights go to the rollouts (the packed buckets);
* `awake` / `asleep`: vLLM's share while it generates / while it sleeps (sync colocated;
  at sleep level 1 its weights' backup is in host memory, at level 2 they are discarded).

Amounts are bytes of the caching allocator (what `torch.cuda.max_memory_allocated`
counts: a trainer's `cuda_peak_gb` is `trainer_peak`), plus `context` items outside it
(CUDA context, NCCL), which the per-GPU plan adds. The activation model counts the tensors
autograd keeps per token of a Qwen2/Llama decoder layer (`layer_activation_bytes`); its
constants are calibrated against measured peaks (docs/memory.md says how close).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.config import RunConfig, TrainerConfig
from runtime.errors import TandemError

GB = 1e9
MIB = 2**20
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BYTE_VOCAB = 259  # runtime/tiny/model.py's tokenizer
CUDA_CONTEXT_GB = 0.6  # a process's CUDA context and kernels, outside the allocator
NCCL_GB = 0.4  # a process's NCCL communicators (several ranks, or an nccl weight group)
VLLM_ASLEEP_GB = 2.0  # what a sleeping vLLM (level 1) keeps: CUDA graphs' pools, its context
VLLM_CONTEXT_GB = 1.8  # what a vLLM engine holds beyond gpu_memory_utilization x GPU (its context)
VLLM_WORKSPACE_GB = 2.0  # vLLM's activation peak and sampler beside weights and KV cache
ACTIVATION_SCALE = 1.0  # measured / counted activation bytes (calibrated; docs/memory.md)
# What a compiled actor's activations measure against an eager one's: torch.compile fuses
# the norms and the MLP's activation, so autograd keeps fewer intermediates (the 1.54B
# trainer at 16384-token micro-batches on one H200: 67.4 GB compiled, 81.2 GB eager, a
# difference of 0.30 of the counted activations; the compiled 1.54B recipe on one H100:
# 47.7 GB where the eager count said 54.9; docs/memory.md).
COMPILED_ACTIVATION_SCALE = 0.70
ALLOCATOR_SLACK = 0.05  # the caching allocator reserves this much beyond a trainer's allocated peak
# A LoRA trainer's allocator leaves far more free space inside its segments: the 7.62B LoRA
# recipe on one H100 ran out of memory with 49.3 GB allocated, 56.2 GB reserved (6.9 GB of free
# blocks no request could use) and 57.6 GB held as nvidia-smi counts it. Beyond the allocated
# memory and CUDA_CONTEXT_GB that is 7.7 GB, 0.42 of what the step held beyond the trainer's
# resident memory (master weights, AdamW, weight-sync buffers: 31.0 GB). PEFT's eager adapters
# allocate many odd sizes.
LORA_ALLOCATOR_SLACK = 0.42  # of a LoRA trainer's step memory: its peak minus what it always holds
# What a vLLM engine with LoRA enabled held beyond gpu_memory_utilization x GPU and VLLM_CONTEXT_GB
# (the 7.62B LoRA recipe at 0.29 of an H100: 27.3 GB as nvidia-smi counts it): its adapter
# slots and the LoRA kernels' buffers and graphs.
VLLM_LORA_GB = 0.7


class ShapeError(TandemError, ValueError):
    """The model's shape cannot be read (no config.json, an unknown architecture)."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    head_dim: int = 0  # 0: hidden / heads (Qwen3 names it; its q may be wider than hidden)
    experts: int = 0  # mixture of experts: experts per layer (0: a dense MLP of `intermediate`)
    experts_per_tok: int = 0  # experts routed per token
    expert_intermediate: int = 0  # each expert's width
    shared_intermediate: int = 0  # a shared expert's width (Qwen2-MoE), 0: none

    @property
    def q_dim(self) -> int:
        return (self.head_dim or self.hidden // self.heads) * self.heads

    @property
    def kv_dim(self) -> int:
        return (self.head_dim or self.hidden // self.heads) * self.kv_heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token passes through: `intermediate` for a dense model, its
        routed experts' and the shared expert's for an MoE."""
        if not self.moe:
            return self.intermediate
        return self.experts_per_tok * self.expert_intermediate + self.shared_intermediate

    def _attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        return h * q + q + 2 * (h * kv + kv) + q * h  # q (bias), k, v (bias), o

    @property
    def layer_params(self) -> int:
        h = self.hidden
        if not self.moe:
            return self._attention_params() + 3 * h * self.intermediate + 2 * h  # gate, up, down; two norms
        return self._attention_params() + self._moe_params(self.experts) + 2 * h

    @property
    def active_layer_params(self) -> int:
        """Parameters one token's forward uses in a layer (`layer_params` for a dense model)."""
        if not self.moe:
            return self.layer_params
        return self._attention_params() + self._moe_params(self.experts_per_tok) + 2 * self.hidden

    def _moe_params(self, experts: int) -> int:
        h = self.hidden
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0  # and its sigmoid gate
        return h * self.experts + experts * 3 * h * self.expert_intermediate + shared  # router, experts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def num_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses (every expert counted in `num_params`, only the
        routed ones here): what a step's FLOPs scale with. `num_params` for a dense model."""
        return self.layers * self.active_layer_params + self.embedding_params + self.hidden

    def vllm_tensors(self) -> list[int]:
        """Elements of each weight as vLLM holds it (q/k/v and gate/up fused; biases and
        norms left out: they share small allocations)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        if self.moe:  # every expert's gate/up fused into one tensor, their downs into another
            mlp = [2 * h * self.expert_intermediate * self.experts, h * self.expert_intermediate * self.experts]
        else:
            mlp = [2 * h * self.intermediate, h * self.intermediate]
        layer = [h * (q + 2 * kv), q * h, *mlp]
        return layer * self.layers + [self.vocab * self.hidden] * (1 if self.tied else 2)

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest weight (the embedding, as a rule)."""
        experts = 2 * self.hidden * self.expert_intermediate * self.experts  # an MoE's gate/up of one layer
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, experts)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters of `rank` on the named projections of every layer."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        dims = {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        return self.layers * sum(rank * (a + b) for t, (a, b) in dims.items() if t in targets)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, c: dict) -> ModelShape:
        """The shape of a dense (Qwen2, Llama) or mixture-of-experts (Qwen3-MoE, Qwen2-MoE:
        `num_experts` or `num_local_experts`, `num_experts_per_tok`, `moe_intermediate_size`)
        config.json."""
        try:
            hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)  # transformers 5 saves the latter
            return cls(
                hidden=hidden,
                layers=int(c["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads),
                intermediate=int(c.get("intermediate_size") or 0),
                vocab=int(c["vocab_size"]),
                tied=bool(c.get("tie_word_embeddings", False)),
                head_dim=int(c.get("head_dim") or 0),
                experts=experts,
                experts_per_tok=int(c.get("num_experts_per_tok") or 0) if experts else 0,
                expert_intermediate=int(c.get("moe_intermediate_size") or 0) if experts else 0,
                shared_intermediate=int(c.get("shared_expert_intermediate_size") or 0) if experts else 0,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShapeError(f"config.json has no decoder shape ({exc})") from None


def model_shape(cfg: RunConfig) -> ModelShape:
    """The policy's shape: `model.path`'s config.json, or the tiny model's."""
    if cfg.model.path:
        path = Path(cfg.model.path) / "config.json"
        try:
            return ModelShape.from_hf_config(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ShapeError(f"cannot read {path}: {exc}") from None
    t = cfg.model.tiny
    return ModelShape(
        hidden=t.hidden_size,
        layers=t.num_layers,
        heads=t.num_heads,
        kv_heads=t.num_kv_heads,
        intermediate=t.intermediate_size,
        head_dim=t.hidden_size // t.num_heads if t.num_experts else 0,
        experts=t.num_experts,
        experts_per_tok=t.num_experts_per_tok if t.num_experts else 0,
        expert_intermediate=t.moe_intermediate_size if t.num_experts else 0,
        vocab=max(BYTE_VOCAB, t.vocab_size),
        tied=t.tie_word_embeddings,
    )


@dataclass(frozen=True)
class Item:
    what: str
    gb: float
    phase: str  # always | step | update | step,update | awake | asleep
    host_gb: float = 0.0  # host memory this consumer takes instead (offload, sleep backups)

    def held_in(self, phase: str) -> bool:
        return self.phase == "always" or phase in self.phase.split(",")


def layer_activation_bytes(s: ModelShape, compute_bytes: int) -> int:
    """Bytes autograd keeps per token of one decoder layer: each RMSNorm its float32 input
    and its output, q after RoPE, k and v, the attention output, and the MLP's gate, up,
    activation and product. A mixture of experts' MLP keeps those at the width of the experts
    a token is routed to, and per routed copy of the token its gathered input, its expert's
    output and that output weighted by the gate (three hidden-size rows, which HF's expert
    loop keeps), and the router's float32 logits and probabilities. Counted so, the bench
    MoE shape's trainer peak at 4096-token micro-batches is within 1 % of the H100
    measurement (docs/moe.md); without the per-copy rows the plan was 12 % under it and
    8192-token micro-batches ran out of memory."""
    h, kv, i = s.hidden, s.kv_dim, s.active_intermediate
    norms = 2 * (4 * h + compute_bytes * h)
    attention = compute_bytes * (2 * h + 2 * kv)
    mlp = compute_bytes * 4 * i
    if s.moe:
        mlp += compute_bytes * 3 * s.experts_per_tok * h + 2 * 4 * s.experts
    return norms + attention + mlp


def trainer_memory(cfg: RunConfig, shape: ModelShape, world: int, *, critic: bool = False) -> list[Item]:
    """One FSDP2 rank's consumers (see the module docstring); `critic`: the value model."""
    t, f = cfg.trainer, cfg.fsdp
    n = shape.num_params - (shape.vocab * shape.hidden if critic and not shape.tied else 0)
    master_b = BYTES[f.param_dtype]
    compute_b = BYTES[f.mixed_precision.param_dtype] if f.mixed_precision else master_b
    grad_b = BYTES[f.mixed_precision.reduce_dtype] if f.mixed_precision else master_b
    shard = _shard_size(cfg, world)
    lora = t.lora.rank > 0 and not critic
    trained = shape.lora_params(t.lora.rank, t.lora.target_modules) if lora else n
    offload = t.offload if not critic else type(t.offload)()
    if f.cpu_offload:
        return _fully_offloaded(cfg, shape, n, trained, shard, critic=critic, lora=lora)
    weights, what = _master_weights(cfg, n, trained, lora=lora)
    items = [
        Item(
            f"master weights ({what} / {shard})",
            weights / shard / GB,
            "step,update" if offload.params else "always",
            weights / shard / GB if offload.params else 0.0,
        ),
        Item(
            f"compute copy ({f.mixed_precision.param_dtype if f.mixed_precision else f.param_dtype})",
            _gathered(cfg, shape, n, shard) * compute_b / GB,
            "step",
        ),
        Item(f"gradients ({count_text(trained)} x {grad_b} B)", trained * grad_b / shard / GB, "step"),
    ]
    adam = 2 * trained * master_b / shard / GB
    if offload.optimizer:
        items.append(Item("AdamW moments (host, streamed)", 2 * 2 * offload.chunk_mb * MIB / GB, "step", adam))
    else:
        items.append(Item("AdamW moments (2 x fp32)", adam, "always"))
    mbt = cfg.critic.micro_batch_tokens if critic else t.micro_batch_tokens
    acts = _activations(cfg, shape, mbt, compute_b, critic=critic) / GB
    compiled = ", compiled" if not critic and compiles_on_gpu(t) and not shape.moe else ""
    items.append(Item(f"activations ({mbt} tokens per micro-batch{compiled})", acts, "step"))
    if not critic:
        items.append(Item("LM head logits", _head(cfg, shape, mbt, compute_b, trains_head=not lora) / GB, "step"))
        kl = cfg.algorithm.kl
        if kl.enabled and kl.use == "loss" and not lora:
            items.append(Item("reference model", n * master_b / shard / GB, "always"))
    return items


def _master_weights(cfg: RunConfig, n: int, trained: int, *, lora: bool) -> tuple[float, str]:
    """Bytes of the `n` parameters a rank keeps (before sharding) and how they are made up: all
    in `fsdp.param_dtype`, except that under LoRA with mixed precision the frozen base is kept in
    the compute dtype (roles/training/peft_lora.py `store_frozen_in`) and only the `trained`
    adapters in the master dtype."""
    f = cfg.fsdp
    master_b = BYTES[f.param_dtype]
    if not lora or f.mixed_precision is None or BYTES[f.mixed_precision.param_dtype] == master_b:
        return n * master_b, f"{count_text(n)} x {master_b} B"
    frozen_b = BYTES[f.mixed_precision.param_dtype]
    frozen = n - trained
    return (
        trained * master_b + frozen * frozen_b,
        f"{count_text(trained)} x {master_b} B, frozen base {count_text(frozen)} x {frozen_b} B",
    )


def _fully_offloaded(
    cfg: RunConfig, shape: ModelShape, n: int, trained: int, shard: int, *, critic: bool, lora: bool
) -> list[Item]:
    """One rank's consumers under FSDP2's `CPUOffloadPolicy` (`fsdp.cpu_offload`, roles/fsdp/wrap.py):
    the float32 master shards, their gradients and AdamW's moments live in (pageable) host memory
    and the optimizer steps there; the GPU holds the compute copy of the gathered parameters (all of
    them on one rank: they stay gathered over a step's micro-batches), the activations and logits,
    and the gradients of the FSDP unit being reduced (its compute-dtype gradients and the float32
    reduce buffers, in and out) before they go to the host. Every micro-batch's gradients are
    reduced (roles/fsdp/wrap.py `reduces_each_micro_batch`): no unsharded float32 copy stays on
    the GPU. The root (embeddings and head) is reduced last, after the activations are freed, so
    its reduce counts only where it exceeds them."""
    t, f = cfg.trainer, cfg.fsdp
    master_b = BYTES[f.param_dtype]
    compute_b = BYTES[f.mixed_precision.param_dtype] if f.mixed_precision else master_b
    grad_b = BYTES[f.mixed_precision.reduce_dtype] if f.mixed_precision else master_b
    mbt = cfg.critic.micro_batch_tokens if critic else t.micro_batch_tokens
    acts = _activations(cfg, shape, mbt, compute_b, critic=critic) / GB
    head = _head(cfg, shape, mbt, compute_b, trains_head=not lora) / GB if not critic else 0.0
    per_param = compute_b + 2 * grad_b
    block = (shape.layer_params if not lora else trained / max(1, shape.layers)) * per_param / GB
    root = (shape.embedding_params + shape.hidden if not lora else 0) * per_param / GB
    compiled = ", compiled" if not critic and compiles_on_gpu(t) and not shape.moe else ""
    weights, what = _master_weights(cfg, n, trained, lora=lora)
    items = [
        Item(f"master weights ({what} / {shard}, fsdp.cpu_offload)", 0.0, "always", weights / shard / GB),
        Item(
            f"compute copy ({f.mixed_precision.param_dtype if f.mixed_precision else f.param_dtype})",
            _gathered(cfg, shape, n, shard) * compute_b / GB,
            "step",
        ),
        Item(
            f"gradients ({count_text(trained)} x {grad_b} B, fsdp.cpu_offload)",
            0.0,
            "step",
            trained * grad_b / shard / GB,
        ),
        Item("gradients of the unit being reduced", max(block, root - acts - head), "step"),
        Item("AdamW moments (2 x fp32, host; the CPU steps)", 0.0, "always", 2 * trained * master_b / shard / GB),
        Item(f"activations ({mbt} tokens per micro-batch{compiled})", acts, "step"),
    ]
    if not critic:
        items.append(Item("LM head logits", head, "step"))
        kl = cfg.algorithm.kl
        if kl.enabled and kl.use == "loss" and not lora:
            items.append(Item("reference model", n * master_b / shard / GB, "always"))
    return items


def weight_sync_items(cfg: RunConfig, shape: ModelShape, backend: str) -> list[Item]:
    """Trainer rank 0's GPU memory for weight updates over `backend` (ipc, nccl): the two
    bucket buffers it keeps from the first update on (roles/weights/layout.py), and while
    it packs, the cast tensors of the bucket being packed and of the next one, and the
    largest tensor gathered and cast (a bucket of its own when it is larger)."""
    if backend not in ("ipc", "nccl"):
        return []
    if cfg.trainer.lora.rank:  # only the adapters travel: buckets no larger than all of them
        lora = cfg.trainer.lora
        sent = shape.lora_params(lora.rank, lora.target_modules) * BYTES[cfg.model.dtype]
        bucket = min(cfg.weight_sync.bucket_mb * MIB, sent)
        tensor = lora.rank * max(shape.hidden, shape.intermediate)
    else:
        bucket = max(cfg.weight_sync.bucket_mb * MIB, shape.largest_tensor * BYTES[cfg.model.dtype])
        tensor = shape.largest_tensor
    largest = tensor * (BYTES[cfg.fsdp.param_dtype] + BYTES[cfg.model.dtype])
    return [
        Item(f"weight-sync buffers (2 x {bucket / MIB:.0f} MiB, {backend})", 2 * bucket / GB, "always"),
        Item("weight export (two buckets' tensors, the largest cast)", (2 * bucket + largest) / GB, "update"),
    ]


def rollout_memory(cfg: RunConfig, shape: ModelShape, gpu_gb: float, *, sleeps: bool) -> list[Item]:
    """A vLLM rollout's share of its GPU: `gpu_memory_utilization` of the whole GPU while
    awake; what a sleeping engine keeps, and its weights' backup in host memory, if `sleeps`."""
    e = cfg.rollout.engine
    share = e.gpu_memory_utilization * gpu_gb
    weights = vllm_weights_gb(cfg, shape)
    items = [Item(f"vLLM (gpu_memory_utilization {e.gpu_memory_utilization:g})", share, "awake")]
    if cfg.trainer.lora.rank:
        items.append(Item("vLLM's LoRA slots and kernels (beyond its share)", VLLM_LORA_GB, "awake"))
    if sleeps and sleep_level(cfg) == 2:
        items.append(Item("vLLM asleep (level 2: weights discarded)", VLLM_ASLEEP_GB, "asleep"))
    elif sleeps:
        # vLLM backs each weight up with torch's pinned allocator, which rounds every
        # allocation up to a power of two (2.02x measured for 271.6 MB on torch 2.11).
        backup = sum(pinned_bytes(n * BYTES[cfg.model.dtype] // e.tensor_parallel_size) for n in shape.vllm_tensors())
        items.append(
            Item("vLLM asleep (weights in host memory, pinned)", VLLM_ASLEEP_GB, "asleep", max(weights, backup / GB))
        )
    return items


def sleep_level(cfg: RunConfig) -> int:
    """The vLLM sleep level a sleeping rollout uses: `rollout.engine.sleep_level`, but 1 when
    the trainer trains adapters (their updates keep the base weights, so those must survive)."""
    return 1 if cfg.trainer.lora.rank else cfg.rollout.engine.sleep_level


def pinned_bytes(size: int) -> int:
    """What `size` bytes from torch's pinned (page-locked) host allocator take: the next
    power of two (ATen's CachingHostAllocator, torch 2.11 to 2.13 by default)."""
    return 1 << max(0, size - 1).bit_length() if size > 0 else 0


def vllm_weights_gb(cfg: RunConfig, shape: ModelShape) -> float:
    """GB of weights each GPU of a rollout's vLLM holds (its tensor-parallel share)."""
    return shape.num_params * BYTES[cfg.model.dtype] / cfg.rollout.engine.tensor_parallel_size / GB


def vllm_kv_cache_gb(cfg: RunConfig, shape: ModelShape, gpu_gb: float) -> float:
    """What vLLM's share leaves for its KV cache after its weights and workspace."""
    return cfg.rollout.engine.gpu_memory_utilization * gpu_gb - vllm_weights_gb(cfg, shape) - VLLM_WORKSPACE_GB


def count_text(n: float) -> str:
    """1.54B, 0.3M: a parameter count for a table."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _shard_size(cfg: RunConfig, world: int) -> int:
    f = cfg.fsdp
    if not f.use_fsdp or f.sharding_strategy == "NO_SHARD":
        return 1
    if f.sharding_strategy == "HYBRID_SHARD":
        return f.hybrid_shard_size or world
    return world


def _gathered(cfg: RunConfig, shape: ModelShape, n: int, shard: int) -> int:
    """Parameters held unsharded at once: all of them on one rank (roles/fsdp/wrap.py
    keeps them over a step's micro-batches) or with SHARD_GRAD_OP; else the root's
    (embeddings, head) and three blocks (the current and two prefetched)."""
    if shard == 1 or cfg.fsdp.sharding_strategy == "SHARD_GRAD_OP":
        return n
    return min(n, shape.embedding_params + 3 * shape.layer_params)


def compiles_on_gpu(t: TrainerConfig) -> bool:
    """Whether the actor's decoder blocks are compiled on a GPU: `trainer.compile` true, or
    `auto` with torch's kernels and no LoRA adapters (what roles/trainer/fsdp_engine.py
    does on CUDA; on the CPU `auto` stays eager)."""
    if t.compile != "auto":
        return bool(t.compile)
    return t.kernels == "torch" and t.lora.rank == 0


def _activations(cfg: RunConfig, shape: ModelShape, tokens: int, compute_b: int, *, critic: bool = False) -> float:
    """Bytes autograd holds at the start of backward for one micro-batch of `tokens`, plus
    one layer's backward working set (its recomputed activations when checkpointing); a
    compiled actor keeps `COMPILED_ACTIVATION_SCALE` of them (a mixture of experts is not compiled)."""
    compiled = not critic and compiles_on_gpu(cfg.trainer) and not shape.moe
    scale = ACTIVATION_SCALE * (COMPILED_ACTIVATION_SCALE if compiled else 1.0)
    per_layer = layer_activation_bytes(shape, compute_b) * scale
    working = tokens * per_layer
    if cfg.trainer.gradient_checkpointing:
        kept = tokens * shape.layers * shape.hidden * compute_b  # each block's input
        return kept + working
    return tokens * shape.layers * per_layer + working


def _head(cfg: RunConfig, shape: ModelShape, tokens: int, compute_b: int, *, trains_head: bool) -> float:
    """Bytes of the LM head's logits at their peak (backward): one chunk's logits and
    their float32 gradient, the head weight's float32 gradient (chunked; none when the head
    is frozen, as under LoRA), or the whole micro-batch's logits with their float32 log-softmax."""
    chunk = cfg.trainer.logprob_chunk_tokens
    v, h = shape.vocab, shape.hidden
    if chunk:
        return min(chunk, tokens) * v * (compute_b + 4) + (v * h * 4 if trains_head else 0)
    return tokens * v * (compute_b + 4 + 4)
