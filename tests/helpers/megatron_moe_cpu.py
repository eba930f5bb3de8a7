"""A megatron-core Qwen3-MoE on CPU for the tests: the real `GPTModel` built as the Megatron
engine builds it (roles/megatron/model.py), loaded from an HF directory, run forward and
backward on one gloo rank, fp32.

megatron-core hard-codes CUDA in two places the local layer spec's forward reaches: RoPE moves
its frequencies to `torch.cuda.current_device()`, and attention dropout forks the tensor-parallel
CUDA RNG tracker (dropout is 0 here). `cpu_forward()` points both at the CPU for the test's
duration; `cpu_engine()` also puts the tensors megatron's optimizer, schedule and gradient norm
make on `device="cuda"` on the CPU. Launched runs of the Megatron trainer still need CUDA.

`python -m tests.helpers.megatron_moe_cpu MODEL_DIR` prints one JSON line with:

* `max_logit_diff`: the largest |megatron - transformers| logit on the same weights and
  right-padded sequences (real positions only), and `argmax_agree`;
* `differ` / `exported` / `expected`: the HF names exported back (HF -> megatron -> HF) and
  those whose tensors are not bit-identical to the HF file;
* `replayed_equals_given`, `replay_mismatch`, `replay_disagree`: a forward replaying given
  random experts routes exactly to them (mismatch 0, disagreement > 0 where they differ from
  the router's own); `own_replay_mismatch` / `own_replay_disagree` / `own_replay_logit_diff`:
  replaying the router's own experts changes nothing;
* `router_grad_norms`: every router's gradient norm after a backward through a replayed
  forward, and `aux_loss`.

`python -m tests.helpers.megatron_moe_cpu MODEL_DIR train save|load CKPT_DIR` runs the
Megatron engine itself (`MegatronEngine`: megatron's DDP, optimizer and schedule, `cpu_engine`)
for training steps with routing replayed, and checkpoints and resumes it (`check_training`);
it prints each step's loss, gradient norm and routing figures and the weights' sum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import unittest.mock
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from roles.megatron.convert import ModelDims
from roles.megatron.moe import MegatronMoeRouting, sequence_first
from tests.helpers.ports import free_port, rendezvous_file
from transport.wire import TrainBatch


@contextlib.contextmanager
def cpu_forward() -> Iterator[None]:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with (
        unittest.mock.patch("torch.cuda.current_device", lambda: torch.device("cpu")),
        unittest.mock.patch.object(tracker, "fork", lambda *a, **k: contextlib.nullcontext()),
    ):
        yield


class RecordingRouting(MegatronMoeRouting):
    """The engine's routing that also keeps each layer's chosen experts of the last forward."""

    def __init__(self, model: torch.nn.Module, *, normalize: bool) -> None:
        super().__init__(model, normalize=normalize)
        self.chosen: dict[int, torch.Tensor] = {}

    def select(self, layer: int, logits: torch.Tensor, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = super().select(layer, logits, normalize=normalize)
        self.chosen[layer] = chosen.detach()
        return weights, chosen

    def used(self) -> torch.Tensor:
        """[N, L, k]: the experts every layer routed each row to, in megatron's row order."""
        return torch.stack([self.chosen[layer] for layer in range(self.num_layers)], dim=1)


class _CpuTorch:
    """`torch` for a megatron module that makes tensors on `device="cuda"` by name: those go to the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs: dict) -> dict:
        device = kwargs.get("device")
        if device == "cuda" or getattr(device, "type", None) == "cuda":
            kwargs["device"] = "cpu"
        return kwargs

    def tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **self._cpu(kwargs))

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **self._cpu(kwargs))


# The megatron modules of a training step that make CUDA tensors by name: the optimizer's loss
# scale, the schedule's token count, the gradient norm's buffers.
_CUDA_BY_NAME = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.utils",
)


@contextlib.contextmanager
def cpu_engine() -> Iterator[None]:
    """`cpu_forward`, and megatron's engine parts made on the CPU: its seeds (the CUDA RNG
    tracker has no CPU streams) and the tensors its optimizer, schedule and gradient norm make
    on `device="cuda"` by name. Gradient clipping asserts CUDA tensors: run with `grad_clip` 0."""
    import importlib

    import megatron.core.tensor_parallel

    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_forward())
        seed = unittest.mock.patch.object(
            megatron.core.tensor_parallel, "model_parallel_cuda_manual_seed", lambda s: None
        )
        stack.enter_context(seed)
        for name in _CUDA_BY_NAME:
            stack.enter_context(unittest.mock.patch.object(importlib.import_module(name), "torch", _CpuTorch()))
        yield


def build(model_dir: Path) -> tuple[torch.nn.Module, RecordingRouting, ModelDims]:
    """(MegatronActor, its routing, ModelDims) on CPU, fp32, HF weights loaded."""
    from transformers import AutoConfig

    from roles.megatron.model import load_hf_weights, make_actor, transformer_config

    hf_config = AutoConfig.from_pretrained(model_dir)
    dims = ModelDims.from_hf_config(hf_config)
    config = transformer_config(dims, tp=1, pp=1, dtype=torch.float32, recompute=False)
    config = dataclasses.replace(config, use_cpu_initialization=True)
    actor = make_actor("", hf_config, config, dims, torch.device("cpu"))
    load_hf_weights(actor, model_dir, dims)
    return actor, RecordingRouting(actor, normalize=dims.norm_topk), dims


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded rows of 24, 17 and 9 tokens: ids [3, 24] and the attention mask."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 24), generator=g)
    mask = torch.zeros(3, 24, dtype=torch.int64)
    for row, n in enumerate((24, 17, 9)):
        mask[row, :n] = 1
    return ids * mask, mask


def check_forward(actor: torch.nn.Module, routing: RecordingRouting, dims: ModelDims, model_dir: Path) -> dict:
    """Megatron's logits against transformers' on the same weights and rows."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = batch(dims.vocab)
    real = mask.bool()
    actor.eval()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        routing.plan(valid=sequence_first(real.flatten(), *ids.shape))
        got = actor(ids)["logits"][..., : dims.vocab]
    diff = (got - want).abs()[real]
    agree = (got.argmax(-1) == want.argmax(-1))[real].float().mean()
    return {"max_logit_diff": float(diff.max()), "argmax_agree": float(agree)}


def check_replay(actor: torch.nn.Module, routing: RecordingRouting) -> dict:
    """A training forward replaying random experts on the real rows, its backward; then a
    forward replaying the routers' own choice."""
    ids, mask = batch(259)
    B, T = ids.shape
    rows = sequence_first(mask.bool().flatten(), B, T)
    L, k, E = routing.num_layers, routing.top_k, routing.num_experts
    g = torch.Generator().manual_seed(5)
    given = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B * T * L)]).view(B * T, L, k)
    out: dict = {}
    actor.train()
    routing.plan(given, rows, replay=True, valid=rows)
    logits = actor(ids)["logits"]
    stats = routing.stats()
    used = routing.used()
    out["replayed_equals_given"] = bool(torch.equal(used[rows], given[rows]))
    out.update(replay_mismatch=float(stats.mismatch), replay_disagree=float(stats.disagree),
               replay_compared=float(stats.compared), aux_loss=float(stats.aux_loss))  # fmt: skip
    (logits.logsumexp(-1).mean() + 0.01 * stats.aux_loss).backward()
    out["router_grad_norms"] = [float(r.weight.grad.norm()) for r in routing.routers]
    actor.eval()
    with torch.no_grad():
        routing.plan(valid=rows)
        base = actor(ids)["logits"]
        own = routing.used()
        routing.plan(own, rows, replay=True, valid=rows)
        again = actor(ids)["logits"]
        stats = routing.stats()
    out.update(own_replay_mismatch=float(stats.mismatch), own_replay_disagree=float(stats.disagree),
               own_replay_logit_diff=float((again - base).abs().max()))  # fmt: skip
    return out


def check_export(actor: torch.nn.Module, dims: ModelDims, model_dir: Path) -> dict:
    """The HF names exported back, and those not bit-identical to the HF file."""
    from safetensors.torch import load_file

    from roles.megatron.model import export_hf_weights

    exported = dict(export_hf_weights(actor, dims, torch.float32))
    want = load_file(str(model_dir / "model.safetensors"))
    if dims.tied:
        want.pop("lm_head.weight", None)
    differ = sorted(k for k in want if k not in exported or not torch.equal(exported[k], want[k].float()))
    return {"exported": sorted(exported), "expected": sorted(want), "differ": differ}


def hf_routing(model_dir: Path, batch: TrainBatch) -> torch.Tensor:
    """transformers' own top-k experts of every token of `batch`, [N, layers, k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    cu = batch.cu_seqlens.tolist()
    rows = []
    with torch.no_grad():
        for i in range(len(cu) - 1):
            ids = batch.input_ids[cu[i] : cu[i + 1]].unsqueeze(0)
            logits = model(input_ids=ids, output_router_logits=True).router_logits
            rows.append(torch.stack([torch.topk(g.float().softmax(-1), k, dim=-1).indices for g in logits], 1))
    return torch.cat(rows)


def train_batch(experts: torch.Tensor | None = None) -> TrainBatch:
    """Five sequences of 7-31 tokens (a 4-token prompt each), with `experts` for every token
    but each sequence's last when given."""
    g = torch.Generator().manual_seed(9)
    lengths = torch.tensor([31, 7, 18, 25, 12])
    n = int(lengths.sum())
    cu = torch.zeros(6, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    mask = torch.ones(n)
    mask[cu[:-1, None] + torch.arange(4)] = 0.0
    batch = TrainBatch(
        step=0, input_ids=torch.randint(0, 259, (n,), generator=g), cu_seqlens=cu, loss_mask=mask,
        behaviour_logprobs=-5.0 + 0.1 * torch.randn(n, generator=g), advantages=torch.randn(n, generator=g),
        global_num_tokens=int(mask.sum()), global_num_seqs=5,
    )  # fmt: skip
    if experts is None:
        return batch
    reported = torch.ones(n, dtype=torch.uint8)
    reported[cu[1:] - 1] = 0
    return msgspec.structs.replace(batch, routed_experts=experts.to(torch.uint8), routed_mask=reported)


def engine_config(model_dir: Path, replay: str, *more: str) -> Any:
    from runtime.config.load import load_config

    overrides = [f"model.path={model_dir}", "trainer.backend=megatron", "fsdp.use_fsdp=false",
                 "trainer.megatron.params_dtype=float32", "trainer.micro_batch_tokens=64",
                 "trainer.loss.router_aux_coef=0.01", f"algorithm.routing_replay={replay}", *more]  # fmt: skip
    return load_config("configs/tiny_cpu.yaml", overrides)


STEP_FIGURES = ("loss", "grad_norm", "lr", "router_aux_loss", "routed_tokens", "router_disagree", "routing_mismatch")


def random_experts(n: int, seed: int, layers: int = 2, k: int = 2, experts: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * layers)]).view(n, layers, k)


def check_training(model_dir: Path, phase: str, directory: Path) -> dict:
    """The Megatron engine's own steps (megatron's DDP, optimizer and schedule, `cpu_engine`),
    routing replayed (`rollout`): `save` trains steps 1-2 (step 1 on transformers' own routing,
    step 2 on random experts), saves a checkpoint into `directory` and trains steps 3-4 on
    random experts; `load` builds a fresh engine, loads the checkpoint and trains steps 3-4."""
    from roles.trainer.megatron_engine import MegatronEngine

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    engine = MegatronEngine(engine_config(model_dir, "rollout", "trainer.optim.grad_clip=0"), model_dir)
    n = int(train_batch().input_ids.numel())

    def step(experts: torch.Tensor) -> dict[str, float]:
        m = engine.train_step(train_batch(experts))
        return {k: m[k] for k in STEP_FIGURES if k in m}

    steps: dict[int, dict[str, float]] = {}
    if phase == "save":
        steps[1] = step(hf_routing(model_dir, train_batch()))
        steps[2] = step(random_experts(n, 2))
        engine.save(directory)
    else:
        engine.load(directory)
    for i in (3, 4):
        steps[i] = step(random_experts(n, i))
    weight_sum = float(sum(t.double().sum() for _, t in engine.export_weights(torch.float32)))
    return {"phase": phase, "version": engine.version, "steps": steps, "weight_sum": weight_sum}


def main() -> None:
    from megatron.core import parallel_state as ps

    model_dir = Path(sys.argv[1])
    if sys.argv[2:3] == ["train"]:
        with cpu_engine():
            out = check_training(model_dir, sys.argv[3], Path(sys.argv[4]))
        print(json.dumps(out), flush=True)
        return
    dist.init_process_group("gloo", init_method=rendezvous_file(), rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    actor, routing, dims = build(model_dir)
    with cpu_forward():
        out = check_forward(actor, routing, dims, model_dir)
        out.update(check_replay(actor, routing))
    out.update(check_export(actor, dims, model_dir))
    print(json.dumps(out), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
