"""Packed micro-batches and chunked logprobs on the real FSDP2 actor engine (one gloo rank,
tiny Qwen2, float32): the same step as the padded, full-logits path.

One batch holds one long sequence and many short ones. For packing on/off × chunked
logprobs on/off, one `train_step` must give the padded full-logits engine's loss and
gradients (float32, 1e-5) and the same per-token logprobs; packed steps report
padding_fraction 0, padded ones the real share.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from roles.fsdp.actor_forward import token_stats
from roles.kernels import logit_kernels
from roles.trainer.fsdp_engine import FSDPEngine
from runtime.config.load import load_config
from runtime.tiny.model import make_tiny_model
from tests.helpers.one_rank import one_rank_world
from transport.wire import TrainBatch

LENGTHS = [300, *range(5, 45, 3)]  # one long, many short: 14 short of 5..44 tokens
PROMPT = 3


@pytest.fixture(scope="module", autouse=True)
def _one_rank_world() -> None:
    one_rank_world()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("packing") / "tiny", max_position_embeddings=512)


def _engine(model: Path, *overrides: str) -> FSDPEngine:
    base = [
        "trainer.device=cpu",
        "fsdp.param_dtype=float32",
        "trainer.optim.grad_clip=0",
        "trainer.loss.entropy_coef=0.01",
    ]
    return FSDPEngine(load_config(None, [*base, *overrides]), model)


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    mask = torch.cat([torch.cat([torch.zeros(PROMPT), torch.ones(n - PROMPT)]) for n in LENGTHS])
    adv = torch.cat([torch.full((n,), (-1.0) ** i) for i, n in enumerate(LENGTHS)]) * mask
    return TrainBatch(
        step=0, input_ids=torch.randint(3, 250, (total,), generator=g), cu_seqlens=cu, loss_mask=mask,
        behaviour_logprobs=-5.0 * mask, advantages=adv, global_num_tokens=float(mask.sum()),
        global_num_seqs=len(LENGTHS),
    )  # fmt: skip


def _step(engine: FSDPEngine, batch: TrainBatch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer_step

    def recording(*args: Any, **kwargs: Any) -> dict[str, float]:
        grads.update(
            {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters() if p.grad is not None}
        )
        return step(*args, **kwargs)

    engine.optimizer_step = recording  # type: ignore[method-assign]
    return engine.train_step(batch), grads


Reference = tuple[dict[str, float], dict[str, torch.Tensor], torch.Tensor]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    engine = _engine(
        model_dir, "trainer.packing=false", "trainer.logprob_chunk_tokens=0", "trainer.micro_batch_tokens=100000"
    )
    logp = _logprobs(engine, _batch())
    metrics, grads = _step(engine, _batch())
    return metrics, grads, logp


def _logprobs(engine: FSDPEngine, batch: TrainBatch) -> torch.Tensor:
    """Every sequence's next-token logprobs, concatenated in batch order."""
    out = torch.zeros(batch.input_ids.numel())
    with torch.no_grad():
        for mb in engine.micro_batches(batch, engine.micro_batch_tokens):
            logp = token_stats(engine.model, mb, entropy_grad=False)[0]
            for i, (s, e) in enumerate(mb.spans):
                out[s + 1 : e] = logp[i, : e - s - 1]
    return out


@pytest.mark.parametrize(
    ("packing", "chunk", "budget"),
    [("true", 0, 100000), ("false", 7, 100000), ("true", 7, 100000), ("true", 16, 128), ("false", 0, 128)],
)
def test_packed_and_chunked_step_equals_padded_full_logits(
    model_dir: Path, reference: Reference, packing: str, chunk: int, budget: int
) -> None:
    ref_metrics, ref_grads, ref_logp = reference
    engine = _engine(
        model_dir,
        f"trainer.packing={packing}",
        f"trainer.logprob_chunk_tokens={chunk}",
        f"trainer.micro_batch_tokens={budget}",
    )
    torch.testing.assert_close(_logprobs(engine, _batch()), ref_logp, atol=1e-5, rtol=1e-5)
    metrics, grads = _step(engine, _batch())
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
    assert metrics["entropy"] == pytest.approx(ref_metrics["entropy"], abs=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    if packing == "true":
        assert metrics["padding_fraction"] == 0.0
        assert metrics["micro_batches"] == (1 if budget > sum(LENGTHS) else 4)
    else:
        assert metrics["padding_fraction"] > 0.0
    assert ref_metrics["padding_fraction"] > 0.8  # one micro-batch: every short row padded to 300


def test_one_rank_reduces_gradients_once_per_step(model_dir: Path, reference: Reference) -> None:
    """On one rank FSDP2's gathers and reductions are only copies: the engine reduces and
    reshards after the last of the step's 4 micro-batches alone (`gradient_sync_once`), and
    its gradients are still the one-micro-batch step's (as in the test above, budget 128)."""
    engine = _engine(model_dir, "trainer.micro_batch_tokens=128")
    calls = {name: _record(engine.model, name) for name in ("set_requires_gradient_sync", "set_reshard_after_backward")}
    metrics, grads = _step(engine, _batch())
    assert metrics["micro_batches"] == 4
    for seen in calls.values():  # the last True: left on for whoever comes next
        assert seen == [False, False, False, True, True]
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_reducing_each_micro_batch_gives_the_same_sums(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fsdp.one_rank_accumulation=reduced` reduces every micro-batch's bf16 gradients into
    the sharded fp32 ones, the parameters still gathered until the last: bit for bit the
    gradients of the default, which adds them into FSDP2's unsharded fp32 copy."""
    mixed = ("trainer.micro_batch_tokens=128", "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}")
    gathers = _count(monkeypatch, FSDPParam, "init_unsharded_param")  # once per parameter per gather
    _, want = _step(_engine(model_dir, *mixed), _batch())
    gathered_once = len(gathers)
    engine = _engine(model_dir, *mixed, "fsdp.one_rank_accumulation=reduced")
    calls = {name: _record(engine.model, name) for name in ("set_requires_gradient_sync", "set_reshard_after_backward")}
    gathers.clear()
    metrics, grads = _step(engine, _batch())
    assert 0 < len(gathers) == gathered_once  # the parameters stayed gathered over the 4 micro-batches
    assert metrics["micro_batches"] == 4
    assert calls["set_requires_gradient_sync"] == [True] * 5
    assert calls["set_reshard_after_backward"] == [False, False, False, True, True]
    assert grads.keys() == want.keys() and all(g.dtype == torch.float32 for g in grads.values())
    for name, g in grads.items():
        assert torch.equal(g, want[name]), name


def test_compiled_blocks_and_head_equal_eager_and_do_not_recompile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trainer.compile=true` (the blocks and the chunked head's math) gives the eager step
    over micro-batches of four packed lengths, and compiles each block's code at most twice
    in two steps of different lengths: a guard per layer or per length (as HF's KV cache
    made one per layer) fails the step here, where on a GPU dynamo would send the blocks
    past its recompile limit to eager. Compiled with the aot_eager backend: the graphs are
    the ones CUDA compiles (attention is one opaque op on both); inductor is not run."""
    model = make_tiny_model(tmp_path / "four_layers", max_position_embeddings=512, num_layers=4)
    options = ("trainer.logprob_chunk_tokens=16", "trainer.micro_batch_tokens=128")
    want = _step(_engine(model, *options), _batch())
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    logit_kernels._compiled.cache_clear()
    try:
        engine = _engine(model, "trainer.compile=true", *options)
        metrics, grads = _step(engine, _batch())
        assert metrics["micro_batches"] == 4
        assert metrics["loss"] == pytest.approx(want[0]["loss"], abs=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, want[1][name], atol=1e-5, rtol=1e-4, msg=name)
        assert logit_kernels._compiled.cache_info().currsize == 2  # the head's stats and gradient
        other = msgspec.structs.replace(_batch(), cu_seqlens=torch.tensor([0, 90, 170, 250, sum(LENGTHS)]))
        engine.train_step(other)
    finally:
        logit_kernels._compiled.cache_clear()
        torch._dynamo.reset()


def _count(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[None]:
    """One entry per call of `module.name` from now on (the call still goes through)."""
    seen: list[None] = []
    real = getattr(module, name)

    def counting(*args: object, **kwargs: object) -> object:
        seen.append(None)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return seen


def _record(obj: object, name: str) -> list[bool]:
    """Every flag passed to `obj.name(flag)` from now on (the call still goes through)."""
    seen: list[bool] = []
    setter = getattr(obj, name)

    def recording(on: bool, **kw: bool) -> None:
        seen.append(on)
        setter(on, **kw)

    setattr(obj, name, recording)
    return seen
