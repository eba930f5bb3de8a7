"""`trainer.offload` on ONE GPU: the streamed optimizer and the parameter offload.

    python3 -m pytest -m gpu tests/gpu/test_offload_gpu.py -s -o addopts=""

* `StreamedAdamW` on CUDA (pinned host moments, two copy streams) gives exactly
  `torch.optim.AdamW`'s parameters and moments, and holds only its two chunk slots on the
  GPU between steps (the moments are in pinned host memory);
* the FSDP2 actor with `offload.optimizer` keeps its moments (DTensors) in pinned host
  memory and trains like one without (bf16 compute, same batches: equal parameters), and
  with `offload.params` its parameters leave the GPU
  after `offload_params` (allocated memory falls by their size) and come back bit for bit
  before the next step, which then equals the step of an actor that never offloaded;
* FSDP2's full offload (`fsdp.cpu_offload`) on one rank keeps master weights, gradients and
  moments in pageable host memory and trains like an actor without it that also reduces each
  micro-batch (the optimizer step on the CPU instead of the GPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from roles.fsdp.offload import StreamedAdamW
from roles.fsdp.wrap import full_state_dict_items
from roles.trainer.fsdp_engine import FSDPEngine
from runtime.memory.auto import load_settled
from runtime.tiny.model import make_tiny_model
from tests.helpers.one_rank import ONE_GPU_ENGINE, full_params, one_rank_cuda_world, toy_batch

pytestmark = pytest.mark.gpu
HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ENGINE = ONE_GPU_ENGINE


@pytest.fixture(scope="module", autouse=True)
def _one_rank_world() -> None:
    one_rank_cuda_world()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("offload") / "m", hidden_size=256, num_layers=4,
                           intermediate_size=512, num_heads=4, num_kv_heads=2)  # fmt: skip


def test_streamed_adamw_on_cuda_equals_adamw() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 1024), (7,), (3000, 333)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda")) for s in shapes]
    own = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    adamw = torch.optim.AdamW(ref, **HYPER)  # type: ignore[arg-type]
    streamed = StreamedAdamW(own, chunk_bytes=4 << 20, **HYPER)  # 4 MiB chunks: tensors split across them
    for _ in range(3):
        for p, q in zip(ref, own, strict=True):
            p.grad = torch.randn(p.shape, generator=g, device="cuda")
            q.grad = p.grad.clone()
        adamw.step()
        streamed.step()
    torch.cuda.synchronize()
    for p, q in zip(ref, own, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            moment = streamed.state[q][key]
            assert moment.device.type == "cpu" and moment.is_pinned()
            assert torch.equal(adamw.state[p][key].cpu(), moment)
    print(f"streamed step: {streamed.last_step_s:.4f} s")


def test_moments_pin_exactly_their_size() -> None:
    """torch's pinned allocator rounds 271.6 MB up to 536.9 MB (measured on torch 2.11: 2.02x);
    the moments' one page-locked buffer costs the host its size and no more."""
    import psutil

    params = [torch.nn.Parameter(torch.zeros(18944, 3584, device="cuda")) for _ in range(2)]  # a 7B MLP's shape
    opt = StreamedAdamW(params, chunk_bytes=64 << 20, **HYPER)
    for p in params:
        p.grad = torch.ones_like(p)
    rss = psutil.Process().memory_info().rss
    opt.step()
    grown = psutil.Process().memory_info().rss - rss
    assert opt.host_bytes == 2 * 2 * 18944 * 3584 * 4
    assert all(opt.state[p][k].is_pinned() for p in params for k in ("exp_avg", "exp_avg_sq"))
    assert grown <= 1.05 * opt.host_bytes, (grown, opt.host_bytes)


def test_fsdp2_actor_offloads_optimizer_and_params(model_dir: Path) -> None:
    plain = FSDPEngine(load_settled(None, ENGINE), model_dir)
    off = FSDPEngine(load_settled(None, [*ENGINE, "trainer.offload.optimizer=true", "trainer.offload.chunk_mb=1",
                                        "trainer.offload.params=true"]), model_dir)  # fmt: skip
    batches = [toy_batch(seed) for seed in range(3)]
    for batch in batches[:2]:
        plain.train_step(batch)
        metrics = off.train_step(batch)
        torch.cuda.synchronize()
        moments = [state[k] for state in off.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert moments and all(isinstance(m, DTensor) for m in moments)  # DCP saves them as AdamW's
        assert all(m.to_local().device.type == "cpu" and m.to_local().is_pinned() for m in moments)
        before = full_params(off)
        held = torch.cuda.memory_allocated()
        off.offload_params()
        torch.cuda.synchronize()
        size = sum(p.to_local().numel() * p.element_size() for p in off.model.parameters())
        assert held - torch.cuda.memory_allocated() >= size  # the parameters left the GPU
        assert all(p.to_local().device.type == "cpu" for p in off.model.parameters())
        off.restore_params()
        assert all(torch.equal(before[n], t) for n, t in full_params(off).items())
    assert metrics["optimizer_offload_s"] > 0 and "params_restore_s" in metrics
    off.offload_params()
    plain.train_step(batches[2])
    off.train_step(batches[2])  # restores the parameters itself
    for name, tensor in full_params(plain).items():
        torch.testing.assert_close(full_params(off)[name], tensor, rtol=0, atol=0, msg=name)


def test_fsdp2_full_offload_trains_like_the_actor_on_the_gpu(model_dir: Path) -> None:
    """Several micro-batches a step, each reduced to the host (no unsharded fp32 accumulator on
    the GPU: runtime/memory/estimate.py counts none); fp32 sums in the same order as the GPU
    actor's `reduced` accumulation, AdamW on the CPU."""
    small = ["trainer.micro_batch_tokens=16"]
    plain = FSDPEngine(load_settled(None, [*ENGINE, *small, "fsdp.one_rank_accumulation=reduced"]), model_dir)
    full = FSDPEngine(load_settled(None, [*ENGINE, *small, "fsdp.cpu_offload=true"]), model_dir)
    for seed in range(3):
        batch = toy_batch(seed)
        plain.train_step(batch)
        metrics = full.train_step(batch)
        torch.cuda.synchronize()
        assert metrics["micro_batches"] > 1
        assert all(p.to_local().device.type == "cpu" and not p.to_local().is_pinned() for p in full.model.parameters())
        moments = [state[k] for state in full.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert moments and all(m.to_local().device.type == "cpu" for m in moments)
    exported = list(full.export_weights(torch.bfloat16))  # gathered and cast on the GPU, never through the host
    assert exported and all(t.device.type == "cuda" and t.dtype == torch.bfloat16 for _, t in exported)
    # AdamW on the host rounds otherwise than CUDA's: where a gradient is near 0, Adam's
    # m / (sqrt(v) + eps) turns on that rounding, and an element can end a small fraction of one
    # update apart (one of 66304 by 3.3e-7 at lr 1e-3 on an H100). The bound, a thousandth of an
    # update, is far below what a micro-batch lost or counted twice does to the gradients.
    got = {n: t.detach().cpu() for n, t in full_state_dict_items(full.model)}
    for name, tensor in full_state_dict_items(plain.model):
        torch.testing.assert_close(
            got[name], tensor.detach().cpu(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
