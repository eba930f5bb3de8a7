"""Packed micro-batches and chunked logprobs on ONE GPU, with Qwen2.5's 151,936-token vocabulary.

    python3 -m pytest -m gpu tests/gpu/test_packing_gpu.py -s -o addopts="" --junitxml=OUT.xml

* the CUDA varlen kernel (`cuda_kernel()`, printed) equals one causal SDPA per sequence,
  output and q/k/v gradients, bf16, GQA 12/2 heads;
* `chunked_token_stats` equals the full-logits logprobs and entropy, value and gradient,
  on 4096 positions of the real vocabulary (bf16 hidden, fp32 math), eager and compiled,
  and its peak memory above the inputs is under half the full computation's;
* the actor engine's packed, chunked step equals its padded, full-logits one on a small
  model with the real vocabulary (bf16 compute: logprobs 2e-2, loss 1e-2 relative) and
  reports padding_fraction 0;
* the 1.54B model (Qwen2.5-1.5B shape, bf16 compute as the bench configs train) trains a
  16,384-token micro-batch without running out of memory (the model is made once under
  /tmp/tandem_bench_trainer_model, shared with benchmarks/trainer.py).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from roles.algo import entropy_from_logits, token_logprobs
from roles.kernels.token_stats import chunked_token_stats
from roles.kernels.varlen import cuda_kernel, varlen_attention_forward
from runtime.memory.auto import load_settled
from runtime.tiny.model import make_tiny_model
from tests.helpers.one_rank import one_rank_cuda_world
from tests.helpers.packed_attention import LENGTHS, packed_qkv

pytestmark = pytest.mark.gpu
VOCAB = 151936
MODELS = Path("/tmp/tandem_bench_trainer_model")


@pytest.fixture(scope="module", autouse=True)
def _one_rank_world() -> None:
    one_rank_cuda_world()


def test_varlen_kernel_equals_sdpa_per_sequence() -> None:
    print("cuda varlen kernel:", cuda_kernel())
    cu, q, k, v = packed_qkv()
    out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    spans = list(itertools.pairwise(cu.tolist()))
    ref = [
        F.scaled_dot_product_attention(q[..., s:e, :], k[..., s:e, :], v[..., s:e, :], is_causal=True, enable_gqa=True)
        for s, e in spans
    ]
    ref_out = torch.cat(ref, dim=2).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), g)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("compiled", [False, True])
def test_chunked_token_stats_equal_full_logits_with_the_real_vocabulary(compiled: bool) -> None:
    """Eager and compiled per-chunk math (`trainer.compile`), the head-weight gradient summed
    in the GEMM (`addmm` out_dtype) either way."""
    torch.manual_seed(0)
    T, D = 4096, 1536
    h = (torch.randn(T, D, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(VOCAB, D, device="cuda") * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, VOCAB, (T,), device="cuda")
    a, b = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, ent = chunked_token_stats(h, w, t, 1024, compiled=compiled)
    ((logp * a).sum() + (ent * b).sum()).backward()
    chunked_peak = torch.cuda.max_memory_allocated() - base
    gh, gw = h.grad.clone(), w.grad.clone()  # type: ignore[union-attr]
    h.grad = w.grad = None
    torch.cuda.reset_peak_memory_stats()
    logits = (h @ w.t()).float()
    logp2, ent2 = token_logprobs(logits, t), entropy_from_logits(logits)
    ((logp2 * a).sum() + (ent2 * b).sum()).backward()
    full_peak = torch.cuda.max_memory_allocated() - base
    print(f"chunked (compiled={compiled}) peak {chunked_peak / 1e9:.2f} GB, full {full_peak / 1e9:.2f} GB")
    torch.testing.assert_close(logp, logp2, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(ent, ent2, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(gh, h.grad, atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(gw, w.grad, atol=1e-2, rtol=2e-2)
    assert chunked_peak < 0.5 * full_peak


def _batch(lengths: list[int], vocab: int):  # -> TrainBatch
    from benchmarks.trainer import make_batch

    return make_batch(lengths, vocab)


def _engine(model: Path, *overrides: str):  # -> FSDPEngine
    from roles.trainer.fsdp_engine import FSDPEngine

    base = ["trainer.device=cuda", "fsdp.param_dtype=float32", "trainer.optim.lr=1e-6"]
    base.append("trainer.micro_batch_tokens=16384")
    return FSDPEngine(load_settled(None, [*base, *overrides]), model)


def _logprobs(engine, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Every sequence's next-token logprobs in batch order (0 at each first token)."""
    from roles.fsdp.actor_forward import token_stats

    out = torch.zeros(batch.input_ids.numel())
    with torch.no_grad():
        for mb in engine.micro_batches(batch, engine.micro_batch_tokens):
            logp = token_stats(engine.model, mb.to(engine.device), entropy_grad=False)[0].float().cpu()
            for i, (s, e) in enumerate(mb.spans):
                out[s + 1 : e] = logp[i, : e - s - 1]
    return out


def test_packed_chunked_step_equals_padded_full_logits_with_the_real_vocabulary() -> None:
    model = make_tiny_model(
        MODELS / "small_real_vocab", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=512, max_position_embeddings=4096, vocab_size=VOCAB,
    )  # fmt: skip
    lengths = [3000, *range(20, 600, 37)]
    results = []
    for packing, chunk in (("false", 0), ("true", 1024)):
        engine = _engine(model, f"trainer.packing={packing}", f"trainer.logprob_chunk_tokens={chunk}")
        batch = _batch(lengths, VOCAB)
        results.append((_logprobs(engine, batch)[batch.loss_mask > 0], engine.train_step(batch)))
        del engine
        torch.cuda.empty_cache()
    (padded_logp, padded), (packed_logp, packed) = results
    torch.testing.assert_close(packed_logp, padded_logp, atol=2e-2, rtol=2e-2)
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-2, abs=1e-3)
    assert packed["padding_fraction"] == 0.0 and padded["padding_fraction"] > 0.5


def test_a_16k_token_micro_batch_of_the_1_5b_model_trains() -> None:
    import gc

    from benchmarks.trainer import QWEN25_15B

    gc.collect()  # the engines of the tests before
    torch.cuda.empty_cache()
    model = make_tiny_model(MODELS / "qwen25_15b", **QWEN25_15B)  # type: ignore[arg-type]
    # As the bench configs train it: bf16 compute, fp32 master weights and reduction.
    engine = _engine(model, "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}")
    torch.cuda.reset_peak_memory_stats()
    metrics = engine.train_step(_batch([4096] * 4, VOCAB))
    peak = torch.cuda.max_memory_allocated() / 1e9
    print(f"16k-token micro-batch of the 1.54B model: train_s {metrics['train_s']:.2f}, peak {peak:.1f} GB")
    assert metrics["micro_batches"] == 1 and torch.isfinite(torch.tensor(metrics["loss"]))
