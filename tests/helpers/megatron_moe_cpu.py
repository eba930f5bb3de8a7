"""A megatron-core Qwen3-MoE on CPU for the tests: the real `GPTModel` built as the Megatron
engine builds it (roles/megatron/model.py), loaded from an HF directory, run forward and
backward on one gloo rank, fp32.

megatron-core hard-codes CUDA in two places the local layer spec's forward reaches: RoPE moves
its frequencies to `torch.cuda.current_device()`, and attention dropout forks the tensor-parallel
CUDA RNG tracker (dropout is 0 here). `cpu_forward()` points both at the CPU for the test's
duration; the engine itself trains on CUDA.

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

`python -m tests.helpers.megatron_moe_cpu MODEL_DIR engine` builds the Megatron engine itself
(`MegatronEngine`, megatron's optimizer replaced by a stand-in: it makes CUDA tensors, and
megatron's schedule does too, so nothing steps here) and runs its micro-batch hooks (forward,
loss, backward) over a batch carrying transformers' own routing (`measure`: `own`) and one
carrying random experts (`rollout`: `replayed`); it prints their summed metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import types
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


def engine_config(model_dir: Path, replay: str) -> Any:
    from runtime.config.load import load_config

    overrides = [f"model.path={model_dir}", "trainer.backend=megatron", "fsdp.use_fsdp=false",
                 "trainer.megatron.params_dtype=float32", "trainer.micro_batch_tokens=64",
                 "trainer.loss.router_aux_coef=0.01", f"algorithm.routing_replay={replay}"]  # fmt: skip
    return load_config("configs/tiny_cpu.yaml", overrides)


def micro_batch_losses(engine: Any, batch: TrainBatch) -> dict:
    """The engine's own hooks over `batch`'s micro-batches as its schedule runs them (forward,
    loss, backward per micro-batch), the metrics summed as the step sums them."""
    from roles.training.metrics import accumulate
    from roles.training.moe import routing_fractions

    acc: dict[str, float] = {}
    mbs = engine._micro_batches(batch, engine.micro_batch_tokens)
    for mb in mbs:
        loss, m = engine.loss(mb, batch, engine.forward(engine.actor, mb))
        loss.backward()
        accumulate(acc, m, engine.metric_names)
    routing_fractions(acc)
    acc["micro_batches"] = len(mbs)
    acc["router_grad_norms"] = [float(r.weight.main_grad.norm() if r.weight.grad is None else r.weight.grad.norm())
                                for r in engine.routing.routers]  # fmt: skip
    return acc


def check_engine(model_dir: Path) -> dict:
    """The Megatron engine built on CPU (megatron's optimizer makes CUDA tensors, so a
    stand-in takes its place; nothing here steps it) and its micro-batch hooks run over
    batches carrying transformers' own routing (measured) and random experts (replayed)."""
    import megatron.core.optimizer
    import megatron.core.tensor_parallel

    from roles.trainer.megatron_engine import MegatronEngine

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    no_optimizer = lambda *a, **k: types.SimpleNamespace(scale_loss=lambda loss: loss)  # noqa: E731
    with (
        unittest.mock.patch.object(megatron.core.optimizer, "get_megatron_optimizer", no_optimizer),
        unittest.mock.patch.object(megatron.core.tensor_parallel, "model_parallel_cuda_manual_seed", lambda s: None),
    ):
        engine = MegatronEngine(engine_config(model_dir, "measure"), model_dir)
    own = hf_routing(model_dir, train_batch())
    out = {"own": micro_batch_losses(engine, train_batch(own))}
    engine.cfg = engine_config(model_dir, "rollout")
    g = torch.Generator().manual_seed(4)
    n, (L, k) = own.shape[0], own.shape[1:]
    random = torch.stack([torch.randperm(engine.routing.num_experts, generator=g)[:k] for _ in range(n * L)])
    out["replayed"] = micro_batch_losses(engine, train_batch(random.view(n, L, k)))
    out["metric_names"] = list(engine.metric_names.all())
    return out


def main() -> None:
    from megatron.core import parallel_state as ps

    model_dir = Path(sys.argv[1])
    if sys.argv[2:] == ["engine"]:
        with cpu_forward():
            out = check_engine(model_dir)
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
