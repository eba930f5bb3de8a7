"""Packed, length-balanced micro-batches on 2 gloo ranks with unequal shards (real FSDP2
actor engine, tiny Qwen2, float32): every rank runs the same number of micro-batches, and
the step's loss and gradients equal the padded full-logits engine's on the whole batch in
one rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roles.trainer.fsdp_engine import FSDPEngine
from runtime.config.load import load_config
from runtime.tiny.model import make_tiny_model
from tests.helpers.ports import rendezvous_file, world_of_one
from transport.wire import TrainBatch

SHARDS = [[250, 10, 12], [20 + i for i in range(30)]]  # rank 0: one long, two short; rank 1: many short
BUDGET = 256
BASE = ["trainer.device=cpu", "fsdp.param_dtype=float32", "trainer.optim.grad_clip=0", "trainer.loss.entropy_coef=0.01"]
pytestmark = pytest.mark.slow


def _batch(lengths: list[int], seed: int, num_tokens: int, num_seqs: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    mask = torch.cat([(torch.arange(n) >= 3).float() for n in lengths])
    adv = torch.cat([torch.full((n,), (-1.0) ** i) for i, n in enumerate(lengths)]) * mask
    return TrainBatch(
        step=0, input_ids=torch.randint(3, 250, (int(cu[-1]),), generator=g), cu_seqlens=cu, loss_mask=mask,
        behaviour_logprobs=-5.0 * mask, advantages=adv, global_num_tokens=num_tokens, global_num_seqs=num_seqs,
    )  # fmt: skip


def _shards() -> list[TrainBatch]:
    tokens = [int(_batch(s, r, 0, 0).loss_mask.sum()) for r, s in enumerate(SHARDS)]
    return [_batch(s, r, sum(tokens), sum(map(len, SHARDS))) for r, s in enumerate(SHARDS)]


def _whole() -> TrainBatch:
    parts = _shards()
    cat = {
        k: torch.cat([getattr(p, k) for p in parts])
        for k in ("input_ids", "loss_mask", "behaviour_logprobs", "advantages")
    }
    cu = torch.tensor([0, *[n for s in SHARDS for n in s]]).cumsum(0)
    return msgspec.structs.replace(parts[0], cu_seqlens=cu, **cat)


def _step(engine: FSDPEngine, batch: TrainBatch) -> dict[str, Any]:
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer_step

    def recording(*args: Any, **kwargs: Any) -> dict[str, float]:
        grads.update(
            {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters() if p.grad is not None}
        )
        return step(*args, **kwargs)

    engine.optimizer_step = recording  # type: ignore[method-assign]
    return {"metrics": engine.train_step(batch), "grads": grads}


def worker(rank: int, rendezvous: str, model: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    torch.set_num_threads(1)
    engine = FSDPEngine(
        load_config(None, [*BASE, "trainer.logprob_chunk_tokens=16", f"trainer.micro_batch_tokens={BUDGET}"]),
        Path(model),
    )
    torch.save(_step(engine, _shards()[rank]), Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ranks") / "tiny", max_position_embeddings=512)


def test_two_ranks_run_equal_micro_batch_counts_and_match_one_padded_rank(model_dir: Path, tmp_path: Path) -> None:
    mp.spawn(worker, args=(rendezvous_file(tmp_path), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    counts = [r["metrics"]["micro_batches"] for r in ranks]
    assert counts == [5, 5]  # rank 1's 1035 tokens need 5 bins of 256; rank 0's 3 sequences, 2 empty ones
    assert all(r["metrics"]["padding_fraction"] == 0.0 for r in ranks)
    if not dist.is_initialized():
        world_of_one("gloo")
    padded = ["trainer.packing=false", "trainer.logprob_chunk_tokens=0", "trainer.micro_batch_tokens=100000"]
    ref_engine = FSDPEngine(load_config(None, [*BASE, *padded]), model_dir)
    ref = _step(ref_engine, _whole())
    for r in ranks:
        assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-6)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], atol=1e-5, rtol=1e-4, msg=name)
