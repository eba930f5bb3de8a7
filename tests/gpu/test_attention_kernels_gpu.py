"""`trainer.attention_kernel=fa4|cudnn` on ONE GPU (Hopper or Blackwell).

    python3 -m pytest -m gpu tests/gpu/test_attention_kernels_gpu.py -s -o addopts=""

For each kernel (fa4: flash-attn-4 must be on the path, or its cases are skipped saying so;
cudnn: cuDNN 9, bundled with torch's CUDA wheels):

* its varlen kernels (roles/kernels/varlen_fa4.py, roles/kernels/varlen_cudnn.py) equal
  PyTorch's FA2 varlen (roles/kernels/varlen.py), output and q/k/v gradients, bf16, GQA
  12/2 heads, head dim 128, a sequence of one token among them; eager and inside
  `torch.compile` (fullgraph: the custom ops are opaque to dynamo);
* the actor engine trains with it like with the torch kernels: from the same weights, on the
  same three batches, each step's entropy and gradient norm within bf16 noise, compiled.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from roles.kernels.varlen import varlen_attention_forward
from roles.kernels.varlen_cudnn import cudnn_attention_forward
from roles.kernels.varlen_fa4 import fa4_attention_forward
from roles.trainer.fsdp_engine import FSDPEngine
from runtime.memory.auto import load_settled
from runtime.tiny.model import make_tiny_model
from tests.helpers.one_rank import ONE_GPU_ENGINE, one_rank_cuda_world, toy_batch
from tests.helpers.packed_attention import LENGTHS, packed_qkv

pytestmark = pytest.mark.gpu
MIXED = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"
ENGINE = [*ONE_GPU_ENGINE, MIXED, "trainer.compile=true"]
KERNELS: dict[str, Callable[..., Any]] = {"fa4": fa4_attention_forward, "cudnn": cudnn_attention_forward}


def _needs(kernel: str) -> None:
    if kernel == "fa4" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn-4 is not installed here (its wheels travel in the FA4 carry folders)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    one_rank_cuda_world()
    return make_tiny_model(tmp_path_factory.mktemp("attn") / "m", hidden_size=512, num_layers=4,
                           intermediate_size=1536, num_heads=4, num_kv_heads=2)  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_equals_torch_varlen(kernel: str, compiled: bool) -> None:
    _needs(kernel)
    cu, q, k, v = packed_qkv()
    fn = torch.compile(KERNELS[kernel], fullgraph=True) if compiled else KERNELS[kernel]
    module = torch.nn.Module()
    out, _ = fn(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS))
    ref, _ = varlen_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2, msg=f"d{name}")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_the_engine_trains_with_the_kernel_like_with_torch_kernels(kernel: str, model_dir: Path) -> None:
    _needs(kernel)

    def steps(choice: str) -> list[dict[str, float]]:
        engine = FSDPEngine(load_settled(None, [*ENGINE, f"trainer.attention_kernel={choice}"]), model_dir)
        assert engine.model.config._attn_implementation.endswith(choice) == (choice != "torch")
        return [engine.train_step(toy_batch(seed)) for seed in range(3)]

    want, got = steps("torch"), steps(kernel)
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        print(f"{kernel} step {step}: entropy {w['entropy']:.5f} / {g['entropy']:.5f}, "
              f"grad_norm {w['grad_norm']:.5f} / {g['grad_norm']:.5f}")  # fmt: skip
        assert g["entropy"] == pytest.approx(w["entropy"], rel=1e-2)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=5e-2)
