"""`trainer.attention_kernel=fa4` without a GPU: what CI can hold of it.

* the two custom ops have fake kernels of the real shapes, and their autograd wiring runs a
  backward (on meta tensors, which dispatch to the fakes: no CUDA, no flash-attn-4), with
  gradients of q, k and v's shapes (GQA: k and v have fewer heads);
* a compiled function traces the op as one node (fake tensors, no kernel run);
* off CUDA or in fp32 the backend is roles/training/varlen.py's path, value for value;
* a launch that cannot run it is refused with one line naming the field.

The kernels themselves against PyTorch's FA2 varlen: tests/gpu/test_attention_kernels_gpu.py.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from roles.training.varlen import varlen_attention_forward
from roles.training.varlen_fa4 import fa4_attention_forward, fa4_varlen
from runtime.config_load import ConfigError, load_config
from runtime.validate import check_config
from tests.helpers.one_rank import ONE_GPU_ENGINE

T, H, HKV, D = 37, 6, 2, 16


def _qkv(device: str, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    shapes = [(T, H, D), (T, HKV, D), (T, HKV, D)]
    return tuple(torch.randn(s, dtype=torch.bfloat16, device=device, requires_grad=requires_grad) for s in shapes)


def test_fakes_and_autograd_give_the_real_shapes() -> None:
    q, k, v = _qkv("meta", requires_grad=True)
    cu = torch.tensor([0, 10, 37], dtype=torch.int32, device="meta")
    out, lse = fa4_varlen(q, k, v, cu, 27, D**-0.5)
    assert out.shape == (T, H, D) and out.dtype == torch.bfloat16
    assert lse.shape == (H, T) and lse.dtype == torch.float32
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == ((T, H, D), (T, HKV, D), (T, HKV, D))


def test_a_traced_function_holds_the_op_as_one_node() -> None:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        return fa4_varlen(q, k, v, cu, 27, D**-0.5)[0] * 2

    with FakeTensorMode():
        q, k, v = _qkv("cpu")
        graph = make_fx(attend, tracing_mode="fake")(q, k, v, torch.tensor([0, 10, 37], dtype=torch.int32))
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count("tandem.fa4_varlen.default") == 1, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_off_cuda_the_backend_is_the_torch_path(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, T, D, dtype=dtype) for h in (H, HKV, HKV))
    cu = torch.tensor([0, 10, 37], dtype=torch.int32)
    module = torch.nn.Identity()
    got, _ = fa4_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=27)
    want, _ = varlen_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=27)
    assert torch.equal(got, want) and got.shape == (1, T, H, D)


def test_launch_refuses_fa4_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    fa4 = ["trainer.attention_kernel=fa4"]
    with pytest.raises(ConfigError, match=r"^trainer.attention_kernel=fa4 applies to the FSDP actor only"):
        check_config(load_config(None, [*fa4, "trainer.backend=megatron"]))
    with pytest.raises(ConfigError, match=r"^trainer.attention_kernel=fa4 needs trainer.packing=true"):
        check_config(load_config(None, [*fa4, "trainer.packing=false", *ONE_GPU_ENGINE]))
    with pytest.raises(ConfigError, match=r"^trainer.attention_kernel=fa4 needs trainer.device=cuda"):
        check_config(load_config(None, [*fa4, "trainer.device=cpu"]))

    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match=r"^trainer.attention_kernel=fa4 needs the flash-attn-4 package"):
        check_config(load_config(None, [*fa4, *ONE_GPU_ENGINE]))
    with pytest.raises(ConfigError, match=r"trainer\.attention_kernel"):
        load_config(None, ["trainer.attention_kernel=fa3"])
